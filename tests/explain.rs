//! `tollgate explain`: golden outputs on the example policies, the raw key
//! read from stdin only, and the store keys marked when the secret is not
//! in the environment.

use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `tollgate explain` with `args`, `stdin` piped in and the secret
/// variable set or not: exit code, stdout, stderr.
fn explain(args: &[&str], stdin: &str, secret: Option<&str>) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.arg("explain")
        .args(args)
        .env_remove("TOLLGATE_KEY_SECRET")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(secret) = secret {
        cmd.env("TOLLGATE_KEY_SECRET", secret);
    }
    let mut child = cmd.spawn().expect("run tollgate explain");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("wait");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn golden(file: &str) -> String {
    std::fs::read_to_string(format!("tests/golden/{file}")).expect(file)
}

#[test]
fn a_tenant_on_the_production_policy() {
    let (code, stdout, stderr) = explain(
        &[
            "--config",
            "config/production.yaml",
            "--path",
            "/v1/orders",
            "--tenant",
            "acme",
            "--ip",
            "203.0.113.9",
        ],
        "",
        Some("golden-secret"),
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, golden("explain_production.txt"));
}

#[test]
fn a_raw_key_read_from_stdin_names_its_credential_and_plan() {
    let args = [
        "--config",
        "config/quickstart.yaml",
        "--path",
        "/v1/hello",
        "--ip",
        "192.0.2.1",
        "--key",
        "-",
    ];
    let (code, stdout, stderr) = explain(&args, "tg_demo_4f1c2a\n", None);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, golden("explain_quickstart.txt"));
    // A key that is none of the policy's: refused, and never echoed.
    let (code, stdout, stderr) = explain(&args, "tg_not_a_key_31337\n", None);
    assert_eq!(code, 1);
    assert_eq!(stdout, "");
    assert_eq!(
        stderr.trim_end(),
        "tollgate: the key on stdin is none of the policy's keys"
    );
    // A key on the command line is refused: it would stay in the history.
    let mut inline = args;
    inline[7] = "tg_demo_4f1c2a";
    let (code, _, stderr) = explain(&inline, "", None);
    assert_eq!(code, 1);
    assert!(!stderr.contains("tg_demo_4f1c2a"), "{stderr}");
    assert!(stderr.contains("--key takes `-`"), "{stderr}");
}

#[test]
fn store_keys_are_marked_when_the_secret_is_absent() {
    let (code, stdout, stderr) = explain(
        &[
            "--config",
            "config/production.yaml",
            "--path",
            "/v1/orders",
            "--tenant",
            "acme",
        ],
        "",
        None,
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(
        "  per-tenant (request, key [tenant]): gcra, capacity 500, refill_per_second 100; shared, exact, enforce\n    store key: not computed: TOLLGATE_KEY_SECRET is not set\n    a request costs 1: 500 from a full budget, then 100 a second\n"
    ), "{stdout}");
    assert!(stdout.contains("  ip-guard (pre_auth, key [ip]): token_bucket, capacity 120, refill_per_second 20; local, exact, enforce\n    store key: needs the caller's ip (--ip)\n"), "{stdout}");
}

#[test]
fn a_request_no_route_serves_is_an_error() {
    let (code, stdout, stderr) = explain(
        &[
            "--config",
            "config/production.yaml",
            "--path",
            "/nowhere",
            "--method",
            "delete",
        ],
        "",
        None,
    );
    assert_eq!(code, 1);
    assert_eq!(stdout, "");
    assert_eq!(
        stderr.trim_end(),
        "tollgate: no route serves DELETE /nowhere"
    );
}

fn check_against(new: &str, old: &str) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config", new, "--against", old])
        .output()
        .expect("run tollgate check");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn check_against_lists_what_changes_and_which_budgets_go_down() {
    let (code, stdout) = check_against(
        "tests/golden/production-next.yaml",
        "config/production.yaml",
    );
    assert_eq!(code, 0);
    assert_eq!(stdout, golden("check_against.txt"));
    // The other way round: what was added is removed.
    let (code, stdout) = check_against(
        "config/production.yaml",
        "tests/golden/production-next.yaml",
    );
    assert_eq!(code, 0);
    assert_eq!(stdout, golden("check_against_reverse.txt"));
    let (code, stdout) = check_against("config/production.yaml", "config/production.yaml");
    assert_eq!(code, 0);
    assert!(
        stdout.ends_with("changes against config/production.yaml: none\n"),
        "{stdout}"
    );
    // An old policy that no longer loads is said, and the exit code stays
    // the new policy's.
    let (code, stdout) = check_against("config/production.yaml", "tests/config/unknown_field.yaml");
    assert_eq!(code, 0);
    assert!(!stdout.contains("changes against"), "{stdout}");
}
