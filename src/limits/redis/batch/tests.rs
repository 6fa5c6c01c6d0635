//! The batch driver against a scripted link, in paused time: what a late
//! decision is, the pending bound, and how jobs gather into calls.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::*;

/// How one call of the fake link goes.
#[derive(Clone, Copy)]
enum Reply {
    /// Answers after this long.
    After(Duration),
    /// Never answers.
    Never,
    /// Answers after this long through another task, as a connection's
    /// reader hands a reply over.
    Relayed(Duration),
    /// Answers after this long, odd numbers with an error of their own
    /// (their part of the call failed, the rest went through).
    OddsFail(Duration),
}

/// A link that answers each request with its own number, as scripted, and
/// records the batches it was sent.
#[derive(Default)]
struct Fake {
    script: Mutex<VecDeque<Reply>>,
    calls: Mutex<Vec<Vec<u32>>>,
}

impl Fake {
    fn answering(script: impl IntoIterator<Item = Reply>) -> Self {
        Self {
            script: Mutex::new(script.into_iter().collect()),
            calls: Mutex::default(),
        }
    }
}

#[async_trait]
impl Link for Fake {
    type Request = u32;
    type Reply = u32;

    async fn call(&self, batch: &[&u32]) -> Result<Vec<Result<u32, StoreError>>, StoreError> {
        self.calls
            .lock()
            .unwrap()
            .push(batch.iter().map(|r| **r).collect());
        let next = self.script.lock().unwrap().pop_front();
        match next.unwrap_or(Reply::After(Duration::from_millis(1))) {
            Reply::After(d) => {
                tokio::time::sleep(d).await;
                Ok(batch.iter().map(|r| Ok(**r)).collect())
            }
            Reply::Never => std::future::pending().await,
            Reply::OddsFail(d) => {
                tokio::time::sleep(d).await;
                Ok(batch
                    .iter()
                    .map(|r| match **r % 2 {
                        0 => Ok(**r),
                        _ => Err(StoreError::Script("odd".into())),
                    })
                    .collect())
            }
            Reply::Relayed(d) => {
                let (tx, rx) = oneshot::channel();
                let answer: Vec<Result<u32, StoreError>> = batch.iter().map(|r| Ok(**r)).collect();
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    let _ = tx.send(answer);
                });
                rx.await
                    .map_err(|_| StoreError::Connection("reader gone".into()))
            }
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

const T: Duration = Duration::from_millis(20);

fn batches(fake: Fake, max_pending: usize) -> Arc<Batches<Fake>> {
    let bounds = Bounds {
        timeout: T,
        max_pending,
    };
    Arc::new(Batches::on(Handle::current(), fake, bounds))
}

fn ms(n: u64) -> Reply {
    Reply::After(Duration::from_millis(n))
}

fn submit(b: &Arc<Batches<Fake>>, n: u32) -> tokio::task::JoinHandle<Result<u32, StoreError>> {
    let b = b.clone();
    tokio::spawn(async move { b.submit(0, n).await })
}

/// Lets spawned tasks run up to their next wait, without moving time.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_decision_late_while_the_store_answers_is_shed_not_failed() {
    // Every call takes 15 ms. Behind the first, 300 requests queue at
    // once: two full batches go out (one beside the first call, one when
    // calls end at 15 ms); the last 44 are still queued when their deadline
    // passes at 20 ms, while the store answered 5 ms before.
    let b = batches(Fake::answering([ms(15); 4]), 1_000);
    let first = submit(&b, 0);
    settle().await;
    let rest: Vec<_> = (1..=300).map(|n| submit(&b, n)).collect();
    assert_eq!(first.await.unwrap(), Ok(0));
    let mut answers = Vec::new();
    for job in rest {
        answers.push(job.await.unwrap());
    }
    let sent = 2 * MAX_BATCH;
    assert!(answers[..sent].iter().zip(1..).all(|(a, n)| *a == Ok(n)));
    assert!(answers[sent..]
        .iter()
        .all(|a| *a == Err(StoreError::Overloaded(Overload::Wait))));
    let calls = b.core.link.calls.lock().unwrap().len();
    assert_eq!(calls, 3, "the late ones were never sent");
}

#[tokio::test(start_paused = true)]
async fn a_request_whose_part_failed_alone_gets_its_own_error() {
    // 1 goes out alone; 2 and 3 wait and share the next call, where 3's
    // part fails and 2's goes through.
    let b = batches(
        Fake::answering([ms(5), Reply::OddsFail(Duration::from_millis(5))]),
        100,
    );
    let first = submit(&b, 0);
    settle().await;
    let (two, three) = (submit(&b, 2), submit(&b, 3));
    assert_eq!(first.await.unwrap(), Ok(0));
    assert_eq!(two.await.unwrap(), Ok(2));
    assert_eq!(three.await.unwrap(), Err(StoreError::Script("odd".into())));
    assert_eq!(b.core.link.calls.lock().unwrap()[1], [2, 3], "one call");
}

#[tokio::test(start_paused = true)]
async fn a_store_that_answers_nothing_is_failing() {
    let b = batches(Fake::answering([Reply::Never, Reply::Never]), 100);
    assert_eq!(submit(&b, 1).await.unwrap(), Err(StoreError::Timeout));
    // Answered once, then silent for longer than the timeout: failing.
    let b = batches(Fake::answering([ms(1), Reply::Never]), 100);
    assert_eq!(submit(&b, 1).await.unwrap(), Ok(1));
    tokio::time::advance(Duration::from_millis(100)).await;
    assert_eq!(submit(&b, 2).await.unwrap(), Err(StoreError::Timeout));
}

#[tokio::test(start_paused = true)]
async fn a_reply_that_arrives_as_the_bound_passes_is_an_answer() {
    // The reply is handed over by another task woken at the same instant
    // as the call's bound: it is read before the call is judged.
    for _ in 0..20 {
        let b = batches(Fake::answering([Reply::Relayed(T)]), 100);
        assert_eq!(submit(&b, 7).await.unwrap(), Ok(7));
    }
}

#[tokio::test(start_paused = true)]
async fn after_a_stall_the_store_gets_one_more_bound_to_answer() {
    // The store answers after 45 ms. The thread is kept from running from
    // 0 to 30 ms (time jumps at once): its 20 ms bound fires 10 ms late, so
    // the call gets another 20 ms, to 50 ms, and the answer counts.
    let b = batches(Fake::answering([ms(45)]), 100);
    let job = submit(&b, 7);
    settle().await;
    tokio::time::advance(Duration::from_millis(30)).await;
    assert_eq!(job.await.unwrap(), Ok(7));
    // Once only: a store still silent after the extra bound is failing.
    let b = batches(Fake::answering([ms(60)]), 100);
    let job = submit(&b, 8);
    settle().await;
    tokio::time::advance(Duration::from_millis(30)).await;
    assert_eq!(job.await.unwrap(), Err(StoreError::Timeout));
    // Without a stall, no extra time.
    let b = batches(Fake::answering([ms(25)]), 100);
    assert_eq!(submit(&b, 9).await.unwrap(), Err(StoreError::Timeout));
}

#[tokio::test(start_paused = true)]
async fn decisions_beyond_max_pending_are_shed_at_once() {
    let b = batches(Fake::answering([ms(5), ms(5)]), 2);
    let (one, two) = (submit(&b, 1), submit(&b, 2));
    settle().await;
    assert_eq!(b.pending(), 2);
    assert_eq!(
        b.submit(0, 3).await,
        Err(StoreError::Overloaded(Overload::Pending))
    );
    assert_eq!(one.await.unwrap(), Ok(1));
    assert_eq!(two.await.unwrap(), Ok(2));
    assert_eq!(b.pending(), 0, "every answered job left the count");
    assert_eq!(
        b.submit(0, 4).await,
        Ok(4),
        "room again once they are answered"
    );
}

#[tokio::test(start_paused = true)]
async fn jobs_queued_behind_a_silent_store_fail_with_it_never_sent() {
    // The first call hangs past the 20 ms bound, so it fails; what queued
    // behind it is past its deadline by then, and the store has answered
    // nothing for as long: they fail as the call did (their limits follow
    // their failure mode, they are not shed as overload), never sent.
    let fake = Fake::answering([Reply::Never, ms(1)]);
    let b = batches(fake, 100);
    let first = submit(&b, 1);
    settle().await;
    let behind: Vec<_> = (2..6).map(|n| submit(&b, n)).collect();
    assert_eq!(first.await.unwrap(), Err(StoreError::Timeout));
    for job in behind {
        assert_eq!(job.await.unwrap(), Err(StoreError::Timeout));
    }
    settle().await;
    assert_eq!(b.core.link.calls.lock().unwrap().clone(), vec![vec![1]]);
    assert_eq!(submit(&b, 9).await.unwrap(), Ok(9), "the next call is made");
}

#[tokio::test(start_paused = true)]
async fn jobs_queued_during_a_call_share_the_next() {
    let b = batches(Fake::answering([ms(5), ms(5)]), 1_000);
    let first = submit(&b, 0);
    settle().await;
    let rest: Vec<_> = (1..=10).map(|n| submit(&b, n)).collect();
    assert_eq!(first.await.unwrap(), Ok(0));
    for (n, job) in (1..).zip(rest) {
        assert_eq!(job.await.unwrap(), Ok(n));
    }
    let calls = b.core.link.calls.lock().unwrap().clone();
    assert_eq!(calls, vec![vec![0], (1..=10).collect::<Vec<_>>()]);
}

#[tokio::test(start_paused = true)]
async fn jobs_queued_during_a_call_do_not_wake_the_driver_one_by_one() {
    // A hundred requests arrive one after the other while the first call
    // is out: the store's thread is woken by the call's end, not by each.
    let b = batches(Fake::answering([ms(5), ms(5)]), 1_000);
    let first = submit(&b, 0);
    settle().await;
    let woken = |b: &Arc<Batches<Fake>>| {
        let queues = b.queues.lock().unwrap();
        queues[&0].signal.wakes.load(Ordering::Relaxed)
    };
    let before = woken(&b);
    let mut rest = Vec::new();
    for n in 1..=100 {
        rest.push(submit(&b, n));
        settle().await;
    }
    assert_eq!(woken(&b), before, "not woken while the call is out");
    assert_eq!(first.await.unwrap(), Ok(0));
    for (n, job) in (1..).zip(rest) {
        assert_eq!(job.await.unwrap(), Ok(n));
    }
    let calls = b.core.link.calls.lock().unwrap().clone();
    assert_eq!(calls, vec![vec![0], (1..=100).collect::<Vec<_>>()]);
}

#[tokio::test(start_paused = true)]
async fn a_full_batch_waiting_goes_out_beside_the_call_in_flight() {
    let b = batches(Fake::answering([ms(5), ms(5), ms(5), ms(5)]), 10_000);
    let first = submit(&b, 0);
    settle().await;
    // Two full batches and one more queue behind the first call: the first
    // of them goes out at once, pipelined; the second waits for a call to
    // end, and the last request waits for one more.
    let n = 2 * MAX_BATCH as u32 + 1;
    let rest: Vec<_> = (1..=n).map(|i| submit(&b, i)).collect();
    settle().await;
    assert_eq!(b.core.link.calls.lock().unwrap().len(), 2);
    assert_eq!(first.await.unwrap(), Ok(0));
    for (i, job) in (1..).zip(rest) {
        assert_eq!(job.await.unwrap(), Ok(i));
    }
    let sizes: Vec<usize> = b
        .core
        .link
        .calls
        .lock()
        .unwrap()
        .iter()
        .map(Vec::len)
        .collect();
    assert_eq!(sizes, [1, MAX_BATCH, MAX_BATCH, 1]);
}
