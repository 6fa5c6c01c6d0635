//! One fetch at a time per key: requests that need the same answer while
//! it is being fetched wait for that fetch instead of making their own.
//! If the fetching request goes away (its client left), one of those
//! waiting takes the fetch over.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

/// The fetches in flight, by key.
pub struct SingleFlight<K, V> {
    calls: Mutex<HashMap<K, Arc<OnceCell<V>>>>,
}

impl<K, V> Default for SingleFlight<K, V> {
    fn default() -> Self {
        Self {
            calls: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash + Clone, V: Clone> SingleFlight<K, V> {
    /// The answer for `key`: `fetch` runs once however many ask while it
    /// runs; and whether this caller ran it.
    pub async fn run<F: Future<Output = V>>(
        &self,
        key: &K,
        fetch: impl FnOnce() -> F,
    ) -> (V, bool) {
        let cell = {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            calls.entry(key.clone()).or_default().clone()
        };
        let mut fetched = false;
        let answer = cell
            .get_or_init(|| {
                fetched = true;
                fetch()
            })
            .await
            .clone();
        if fetched {
            // Later requests ask afresh (the answer is cached, or not, by
            // the caller).
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            if calls.get(key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                calls.remove(key);
            }
        }
        (answer, fetched)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(start_paused = true)]
    async fn concurrent_askers_share_one_fetch_and_later_ones_fetch_again() {
        let flights: Arc<SingleFlight<u8, u32>> = Arc::default();
        let fetches = Arc::new(AtomicUsize::new(0));
        let ask = |flights: Arc<SingleFlight<u8, u32>>, fetches: Arc<AtomicUsize>| async move {
            flights
                .run(&7, || async {
                    let n = fetches.fetch_add(1, Ordering::SeqCst) as u32;
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    n
                })
                .await
        };
        let tasks: Vec<_> = (0..10)
            .map(|_| tokio::spawn(ask(flights.clone(), fetches.clone())))
            .collect();
        let mut ran = 0;
        for t in tasks {
            let (answer, fetched) = t.await.unwrap();
            assert_eq!(answer, 0);
            ran += usize::from(fetched);
        }
        assert_eq!((ran, fetches.load(Ordering::SeqCst)), (1, 1));
        assert_eq!(ask(flights, fetches.clone()).await, (1, true));
    }
}
