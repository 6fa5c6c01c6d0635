//! The guard over an in-memory connection, in paused time: each bound
//! fires exactly at its deadline, with no real waiting.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::*;
use crate::metrics::Metrics;

fn settings() -> EdgeSettings {
    EdgeSettings {
        max_header_bytes: 1024,
        header_read: Duration::from_secs(2),
        keepalive_idle: Duration::from_secs(5),
        body_read: Duration::from_secs(3),
        send: Duration::from_secs(4),
        ..EdgeSettings::default()
    }
}

/// A guarded server end, its client end, and the listener's counts.
fn pair(buffer: usize) -> (Guarded, DuplexStream, Arc<Listener>) {
    let (client, server) = tokio::io::duplex(buffer);
    let metrics = Metrics::new();
    let listener = Listener::new("test", &metrics);
    let guarded = Guarded::new(Box::new(server), settings(), listener.clone());
    (guarded, client, listener)
}

/// Reads what the guard hands on until it reports the end of the stream.
async fn read_all(guarded: &mut Guarded) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    guarded.read_to_end(&mut out).await?;
    Ok(out)
}

async fn answer(client: &mut DuplexStream) -> String {
    let mut out = Vec::new();
    client.read_to_end(&mut out).await.unwrap();
    String::from_utf8(out).unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_sends_nothing_is_closed_quietly() {
    let (mut guarded, mut client, listener) = pair(4096);
    let started = Instant::now();
    let mut buf = [0u8; 16];
    assert_eq!(guarded.read(&mut buf).await.unwrap(), 0);
    assert_eq!(started.elapsed(), settings().header_read);
    assert_eq!(listener.rejections(Reason::HeaderTimeout), 1);
    drop(guarded);
    assert_eq!(answer(&mut client).await, "");
}

#[tokio::test(start_paused = true)]
async fn a_head_that_trickles_gets_408_at_its_deadline() {
    let (mut guarded, mut client, listener) = pair(4096);
    client
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 16];
    assert_eq!(guarded.read(&mut buf).await.unwrap(), 0);
    assert_eq!(started.elapsed(), settings().header_read);
    assert_eq!(listener.rejections(Reason::HeaderTimeout), 1);
    drop(guarded);
    let reply = answer(&mut client).await;
    assert!(reply.starts_with("HTTP/1.1 408 "), "{reply}");
    assert!(reply.contains("application/problem+json"));
    assert!(reply.contains("connection: close"));
}

#[tokio::test(start_paused = true)]
async fn an_oversized_head_gets_431() {
    let (mut guarded, mut client, listener) = pair(8192);
    let head = format!(
        "GET / HTTP/1.1\r\nhost: a\r\nx-big: {}\r\n",
        "a".repeat(2000)
    );
    client.write_all(head.as_bytes()).await.unwrap();
    assert_eq!(read_all(&mut guarded).await.unwrap(), b"");
    assert_eq!(listener.rejections(Reason::HeaderTooLarge), 1);
    drop(guarded);
    assert!(answer(&mut client).await.starts_with("HTTP/1.1 431 "));
}

#[tokio::test(start_paused = true)]
async fn ambiguous_framing_gets_400_before_anyone_parses_it() {
    let (mut guarded, mut client, listener) = pair(4096);
    client
        .write_all(b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\nabc")
        .await
        .unwrap();
    assert_eq!(read_all(&mut guarded).await.unwrap(), b"");
    assert_eq!(listener.rejections(Reason::BadRequest), 1);
    drop(guarded);
    let reply = answer(&mut client).await;
    assert!(reply.starts_with("HTTP/1.1 400 "), "{reply}");
    assert!(reply.contains("Content-Length are both present"), "{reply}");
}

#[tokio::test(start_paused = true)]
async fn a_good_head_and_body_pass_unchanged() {
    let (mut guarded, mut client, _) = pair(4096);
    let request = b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\nhello";
    client.write_all(request).await.unwrap();
    let mut got = vec![0u8; request.len()];
    guarded.read_exact(&mut got).await.unwrap();
    assert_eq!(got, request);
    // The body is complete: a read now only watches for the client leaving,
    // however long the upstream takes.
    let mut buf = [0u8; 8];
    let waited = tokio::time::timeout(Duration::from_secs(600), guarded.read(&mut buf)).await;
    assert!(waited.is_err(), "no bound while nothing is due");
}

#[tokio::test(start_paused = true)]
async fn a_body_that_stalls_gets_408_and_ends_the_request() {
    let (mut guarded, mut client, listener) = pair(4096);
    client
        .write_all(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\nhel")
        .await
        .unwrap();
    let mut got = vec![0u8; 40];
    let n = guarded.read(&mut got).await.unwrap();
    assert!(n > 0);
    let started = Instant::now();
    let mut buf = [0u8; 8];
    let err = loop {
        match guarded.read(&mut buf).await {
            Ok(0) => panic!("eof before the timeout"),
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(started.elapsed(), settings().body_read);
    assert_eq!(listener.rejections(Reason::BodyTimeout), 1);
    drop(guarded);
    assert!(answer(&mut client).await.starts_with("HTTP/1.1 408 "));
}

#[tokio::test(start_paused = true)]
async fn a_chunked_body_is_due_until_its_last_chunk() {
    let (mut guarded, mut client, _) = pair(4096);
    let head = b"POST /x HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n";
    client.write_all(head).await.unwrap();
    client.write_all(b"3\r\nabc\r\n").await.unwrap();
    let mut got = vec![0u8; 100];
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], &[&head[..], b"3\r\nabc\r\n"].concat()[..]);
    assert!(guarded.body_due());
    client
        .write_all(b"0\r\n\r\nGET /next HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], b"0\r\n\r\n", "the body, not the next request");
    assert!(!guarded.body_due());
    guarded.next_request(settings());
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], b"GET /next HTTP/1.1\r\nhost: a\r\n\r\n");
}

#[tokio::test(start_paused = true)]
async fn pipelined_requests_are_handed_on_one_at_a_time() {
    let (mut guarded, mut client, _) = pair(4096);
    client
        .write_all(b"GET /a HTTP/1.1\r\nhost: a\r\n\r\nPOST /b HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\nhiGET /c HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut got = vec![0u8; 256];
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], b"GET /a HTTP/1.1\r\nhost: a\r\n\r\n");
    // While the first is answered, reads hand on nothing of the next.
    let idle = tokio::time::timeout(Duration::from_secs(60), guarded.read(&mut got)).await;
    assert!(idle.is_err(), "the next request is kept, not handed on");
    guarded.next_request(settings());
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(
        &got[..n],
        b"POST /b HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\nhi"
    );
    guarded.next_request(settings());
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], b"GET /c HTTP/1.1\r\nhost: a\r\n\r\n");
}

#[tokio::test(start_paused = true)]
async fn a_body_sent_late_with_the_next_request_is_split_between_them() {
    let (mut guarded, mut client, _) = pair(4096);
    client
        .write_all(b"POST /a HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\n")
        .await
        .unwrap();
    let mut got = vec![0u8; 256];
    assert!(guarded.read(&mut got).await.unwrap() > 0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    client
        .write_all(b"helloGET /b HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], b"hello");
    assert!(!guarded.body_due());
    guarded.next_request(settings());
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], b"GET /b HTTP/1.1\r\nhost: a\r\n\r\n");
}

#[tokio::test(start_paused = true)]
async fn a_trickled_body_ends_once_its_rate_falls_behind_after_the_grace() {
    let (mut guarded, mut client, listener) = pair(4096);
    client
        .write_all(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 100000\r\n\r\n")
        .await
        .unwrap();
    let mut got = vec![0u8; 256];
    assert!(guarded.read(&mut got).await.unwrap() > 0);
    // One byte a second: within body_read_ms (3 s) every time, far below
    // 1024 bytes a second.
    let started = Instant::now();
    let trickle = tokio::spawn(async move {
        loop {
            if client.write_all(b"x").await.is_err() {
                return client;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let err = loop {
        match guarded.read(&mut got).await {
            Ok(n) => assert!(n > 0, "eof before the rate failed"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(started.elapsed(), settings().body_grace);
    assert_eq!(listener.rejections(Reason::BodyTooSlow), 1);
    assert_eq!(listener.rejections(Reason::BodyTimeout), 0);
    drop(guarded);
    let mut client = trickle.await.unwrap();
    assert!(answer(&mut client).await.starts_with("HTTP/1.1 408 "));
}

#[tokio::test(start_paused = true)]
async fn a_body_fast_enough_still_ends_at_its_total_deadline() {
    let (mut guarded, mut client, listener) = pair(1 << 20);
    let settings = EdgeSettings {
        body_min_rate: 1,
        body_total: Duration::from_secs(10),
        ..settings()
    };
    guarded.settings = settings;
    client
        .write_all(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 1000000\r\n\r\n")
        .await
        .unwrap();
    let mut got = vec![0u8; 4096];
    assert!(guarded.read(&mut got).await.unwrap() > 0);
    let started = Instant::now();
    let trickle = tokio::spawn(async move {
        loop {
            if client.write_all(&[b'x'; 100]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let err = loop {
        match guarded.read(&mut got).await {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(started.elapsed(), Duration::from_secs(10));
    assert_eq!(listener.rejections(Reason::BodyTooSlow), 1);
    drop(guarded);
    trickle.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_client_that_does_not_read_loses_the_connection() {
    let (mut guarded, client, listener) = pair(64);
    guarded.ready = Bytes::new();
    guarded.phase = Phase::Request;
    let started = Instant::now();
    let big = vec![b'x'; 4096];
    let err = guarded.write_all(&big).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(started.elapsed(), settings().send);
    assert_eq!(listener.rejections(Reason::SendTimeout), 1);
    drop(client);
}

#[tokio::test(start_paused = true)]
async fn between_requests_a_connection_may_idle_for_keepalive_idle() {
    let (mut guarded, mut client, listener) = pair(4096);
    client
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut got = vec![0u8; 64];
    assert!(guarded.read(&mut got).await.unwrap() > 0);
    guarded
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    guarded.next_request(settings());
    let started = Instant::now();
    assert_eq!(guarded.read(&mut got).await.unwrap(), 0);
    assert_eq!(started.elapsed(), settings().keepalive_idle);
    assert_eq!(listener.rejections(Reason::IdleTimeout), 1);
    assert_eq!(listener.rejections(Reason::HeaderTimeout), 0);
}

#[tokio::test(start_paused = true)]
async fn a_second_request_on_the_connection_is_checked_as_the_first() {
    let (mut guarded, mut client, listener) = pair(4096);
    client
        .write_all(b"GET /a HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut got = vec![0u8; 64];
    let n = guarded.read(&mut got).await.unwrap();
    assert_eq!(&got[..n], b"GET /a HTTP/1.1\r\nhost: a\r\n\r\n");
    guarded.next_request(settings());
    client
        .write_all(b"GET /b HTTP/1.1\r\nhost: a\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(guarded.read(&mut got).await.unwrap(), 0);
    assert_eq!(listener.rejections(Reason::BadRequest), 1);
}

#[tokio::test(start_paused = true)]
async fn a_pipelined_request_is_checked_as_its_own_head() {
    let (mut guarded, mut client, listener) = pair(4096);
    client
        .write_all(b"GET /a HTTP/1.1\r\nhost: a\r\n\r\nGET /b HTTP/1.1\r\nhost: a\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n")
        .await
        .unwrap();
    // The proxy takes only the first request's bytes.
    let mut first = vec![0u8; 28];
    guarded.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"GET /a HTTP/1.1\r\nhost: a\r\n\r\n");
    guarded.next_request(settings());
    let mut got = vec![0u8; 64];
    assert_eq!(guarded.read(&mut got).await.unwrap(), 0);
    assert_eq!(listener.rejections(Reason::BadRequest), 1);
}

#[tokio::test(start_paused = true)]
async fn a_timer_fires_at_its_latest_deadline_and_no_earlier() {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut timer = Timer::new();
    let start = Instant::now();
    timer.arm_at(start + Duration::from_secs(1));
    assert!(!timer.expired(&mut cx));
    // Moved on: the sleep under it stays at the earlier deadline.
    timer.arm_at(start + Duration::from_secs(3));
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(
        !timer.expired(&mut cx),
        "the earlier deadline is not this wait's"
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(timer.expired(&mut cx));
    // A nearer deadline moves the sleep back.
    timer.arm_at(Instant::now() + Duration::from_secs(10));
    assert!(!timer.expired(&mut cx));
    timer.arm_at(Instant::now() + Duration::from_millis(500));
    tokio::time::advance(Duration::from_millis(499)).await;
    assert!(!timer.expired(&mut cx));
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(timer.expired(&mut cx));
    timer.disarm();
    assert!(!timer.expired(&mut cx));
}

#[tokio::test(start_paused = true)]
async fn a_waiting_task_is_woken_at_a_deadline_that_moved_on() {
    let mut timer = Timer::new();
    let start = Instant::now();
    timer.arm_at(start + Duration::from_secs(1));
    assert!(!timer.expired(&mut Context::from_waker(std::task::Waker::noop())));
    timer.arm_at(start + Duration::from_secs(3));
    std::future::poll_fn(|cx| {
        if timer.expired(cx) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    assert_eq!(start.elapsed(), Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn keep_alive_requests_do_not_move_the_read_timer_each_time() {
    let (mut guarded, mut client, listener) = pair(4096);
    let mut got = vec![0u8; 64];
    for _ in 0..50 {
        tokio::time::advance(Duration::from_millis(10)).await;
        // The guard waits for each request first, as between the requests
        // of a keep-alive client: its timer is looked at every time.
        let send = async {
            tokio::task::yield_now().await;
            client
                .write_all(b"GET /a HTTP/1.1\r\nhost: a\r\n\r\n")
                .await
                .unwrap();
        };
        let (n, ()) = tokio::join!(guarded.read(&mut got), send);
        assert_eq!(&got[..n.unwrap()], b"GET /a HTTP/1.1\r\nhost: a\r\n\r\n");
        guarded.next_request(settings());
    }
    // Armed for each head and each idle wait, a hundred times in half a
    // second: the sleep was placed once, at the first wait's deadline.
    assert_eq!(guarded.read_timer.moves, 1);
    // And the idle bound still holds from the last request.
    let idle = Instant::now();
    assert_eq!(guarded.read(&mut got).await.unwrap(), 0);
    assert_eq!(idle.elapsed(), settings().keepalive_idle);
    assert_eq!(listener.rejections(Reason::IdleTimeout), 1);
}

#[tokio::test(start_paused = true)]
async fn a_client_slower_than_send_min_rate_is_cut_after_the_grace() {
    let (mut guarded, mut client, listener) = pair(64);
    guarded.settings = EdgeSettings {
        // No gap ever reaches `send_ms`: only the rate can end it.
        send: Duration::from_secs(3600),
        body_grace: Duration::from_secs(2),
        send_min_rate: 1_000,
        ..settings()
    };
    guarded.ready = Bytes::new();
    guarded.phase = Phase::Request;
    // The client takes 64 bytes a second, far below the rate.
    let reader = tokio::spawn(async move {
        let mut got = [0u8; 64];
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            match client.read(&mut got).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    let err = guarded.write_all(&vec![b'x'; 1 << 20]).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(listener.rejections(Reason::SendTooSlow), 1);
    assert_eq!(listener.rejections(Reason::SendTimeout), 0);
    drop(guarded);
    reader.await.unwrap();
}

#[test]
fn only_the_time_a_write_waits_on_its_client_counts_against_its_rate() {
    let s = EdgeSettings {
        send: Duration::from_secs(30),
        body_grace: Duration::from_secs(5),
        send_min_rate: 1_000,
        ..settings()
    };
    let t0 = Instant::now();
    // Nothing taken yet: the grace, then the rate fails.
    assert_eq!(
        send_deadline(&s, t0, Duration::ZERO, 0),
        (t0 + Duration::from_secs(5), Reason::SendTooSlow)
    );
    // 20 000 bytes taken earn 20 s of waiting; 12 s were spent already.
    assert_eq!(
        send_deadline(&s, t0, Duration::from_secs(12), 20_000),
        (t0 + Duration::from_secs(8), Reason::SendTooSlow)
    );
    // Waited past what it earned: the wait in progress fails at once.
    assert_eq!(
        send_deadline(&s, t0, Duration::from_secs(9), 1_000),
        (t0, Reason::SendTooSlow)
    );
    // A fast client's long response: the gap bound comes first.
    assert_eq!(
        send_deadline(&s, t0, Duration::ZERO, 1 << 30),
        (t0 + Duration::from_secs(30), Reason::SendTimeout)
    );
}
