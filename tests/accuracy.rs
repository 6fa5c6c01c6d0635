//! The accuracy harness (`bench/accuracy.py`) on this build: two gateways
//! on one real Redis, no fault, every limit mode at once (the exact
//! algorithms, `on_limit: delay`, `cost_from_response`, a `sync: lease`
//! and a `concurrency` limit). The harness holds each cell against the
//! bound the documentation states: no overage for the exact modes, at most
//! `max_debt` for a cost settled after the response, never more than
//! `max_in_flight` in flight at the upstream; this test holds the harness
//! to its exit status and to a verdict for every cell it was asked for.
//!
//! Only counts are compared with their bounds, never timings: the ideal is
//! computed from the times the client saw, which a slow machine only makes
//! larger. Fault cells, whose outcome depends on when the store failed, are
//! left to the harness itself (`python3 bench/accuracy.py --quick`).

mod support;

use std::io::Read;
use std::process::{Command, Stdio};
use std::thread;
use std::time::Duration;

/// Every mode the harness knows.
const MODES: [&str; 8] = [
    "token_bucket",
    "gcra",
    "sliding_window",
    "quota",
    "lease",
    "delay",
    "cost_from_response",
    "concurrency",
];

/// The cells this test asks for: two instances, no fault, every mode,
/// `on_store_error: closed` (a store too slow to answer refuses, it
/// never admits beyond a budget).
const GRID: &str = "2/none";
const ON_STORE_ERROR: &str = "closed";

/// Far beyond what the run takes (about 15 s), so that only a hung
/// harness ends it.
const LIMIT: Duration = Duration::from_secs(600);

/// Runs the harness on the debug binary and returns its exit success and
/// its output (stdout, then stderr).
fn harness(args: &[&str]) -> (bool, String, String) {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut child = Command::new("python3")
        .arg(format!("{root}/bench/accuracy.py"))
        .args(["--binary", env!("CARGO_BIN_EXE_tollgate")])
        .args(args)
        .current_dir(root)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs bench/accuracy.py");
    let read = |mut pipe: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let started = tollgate::clock::instant();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the harness") {
            break status;
        }
        if tollgate::clock::instant().saturating_duration_since(started) > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the harness ran for more than {LIMIT:?}:\n{}",
                out.join().unwrap()
            );
        }
        thread::sleep(Duration::from_millis(200));
    };
    (status.success(), out.join().unwrap(), err.join().unwrap())
}

#[test]
fn every_mode_keeps_its_stated_bound_across_two_gateways() {
    let modes = MODES.join(",");
    let (ok, out, err) = harness(&[
        "--quick",
        "--grid",
        GRID,
        "--modes",
        &modes,
        "--on-store-error",
        ON_STORE_ERROR,
        // Modest demand for the debug build: 10 a second per limit,
        // asked at 2.5 times that.
        "--rate",
        "10",
        // A slow call is a late answer, not a store failure.
        "--store-timeout-ms",
        "2000",
    ]);
    assert!(
        ok,
        "the harness reported a failed bound or failed:\n{out}\n{err}"
    );
    for mode in MODES {
        let cell = format!("| {GRID}/{mode}/{ON_STORE_ERROR} |");
        let row = out
            .lines()
            .find(|l| l.starts_with(&cell))
            .unwrap_or_else(|| panic!("no row for {cell} in:\n{out}"));
        // The verdict column: the bound was asserted, and it held.
        assert!(row.ends_with("| yes |"), "{row}");
    }
    assert!(out.contains("every stated bound held"), "{out}");
}
