//! The keys file in its line format: credentials `<sha256> <id> <tenant>
//! [<plan>]` read as they are checked, problems at `file:line`, one id
//! space with the policy's own keys, and the gateway admitting a key of it.

mod support;

use std::process::Command;
use std::time::Duration;

use support::{digest, Gateway};

fn check(dir: &std::path::Path) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(dir.join("policy.yaml"))
        .output()
        .expect("run tollgate check");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A policy naming `keys.txt` beside it, with the given inline keys.
fn policy(dir: &std::path::Path, inline: &str, keys: &str) {
    std::fs::write(
        dir.join("policy.yaml"),
        format!(
            r#"
version: 1
auth: {{ keys_file: keys.txt, keys: [{inline}] }}
plans: {{ pro: {{}} }}
routes:
  - {{ name: r, path: /, respond: {{ status: 200 }} }}
"#
        ),
    )
    .unwrap();
    std::fs::write(dir.join("keys.txt"), keys).unwrap();
}

#[test]
fn a_valid_file_loads_every_credential() {
    let dir = tempfile::tempdir().unwrap();
    let keys = format!(
        "# sha256 id tenant [plan]\n\n{} ci-1 acme\n  {}\tci-2   acme pro  \n{} ci-3 globex\n",
        digest("k1"),
        digest("k2"),
        digest("k3")
    );
    policy(dir.path(), "", &keys);
    let (code, stdout, stderr) = check(dir.path());
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(" 3 keys, "), "{stdout}");
}

#[test]
fn problems_name_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let keys = format!(
        "{} ci-1 acme\n{} ci-2\nnot-hex ci-3 acme\n{} ci-4 acme enterprize\n{} ci-1 acme\n{} ci-6 acme\n",
        digest("k1"),
        digest("k2"),
        digest("k4"),
        digest("k5"),
        digest("k1"),
    );
    policy(dir.path(), "", &keys);
    let (code, stdout, stderr) = check(dir.path());
    assert_eq!(code, 1);
    assert_eq!(stdout, "");
    let file = dir.path().join("keys.txt");
    let policy = dir.path().join("policy.yaml");
    let (file, policy) = (file.display(), policy.display());
    assert_eq!(
        stderr.trim_end(),
        [
            format!("{policy}: {file}:2: expected `<sha256> <id> <tenant> [<plan>]`"),
            format!("{policy}: {file}:3.sha256: must be 64 hex digits (the SHA-256 of the raw key; see `tollgate hash-key`)"),
            format!("{policy}: {file}:4.plan: unknown plan \"enterprize\""),
            format!("{policy}: auth: duplicate credential id \"ci-1\""),
            format!("{policy}: auth: credentials \"ci-1\" and \"ci-6\" have the same key digest: a key must name one caller"),
        ]
        .join("\n")
    );
}

#[test]
fn ids_of_the_policy_and_the_file_share_one_space() {
    let dir = tempfile::tempdir().unwrap();
    let inline = format!(
        "{{ id: ci-1, tenant: acme, sha256: \"{}\" }}",
        digest("inline")
    );
    policy(
        dir.path(),
        &inline,
        &format!("{} ci-1 acme\n", digest("file")),
    );
    let (code, _, stderr) = check(dir.path());
    assert_eq!(code, 1);
    assert!(
        stderr.ends_with(": auth: duplicate credential id \"ci-1\"\n"),
        "{stderr}"
    );
}

#[test]
fn a_file_broken_on_every_line_stops_after_a_hundred_problems() {
    let dir = tempfile::tempdir().unwrap();
    policy(dir.path(), "", &"garbage\n".repeat(100_000));
    let (code, _, stderr) = check(dir.path());
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), 101, "{}", &stderr[..300]);
    assert!(
        stderr
            .trim_end()
            .ends_with(":101: stopped after 100 problems"),
        "{stderr}"
    );
}

#[test]
fn oversized_files_are_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    policy(dir.path(), "", "");
    // Sparse: the size is read, the contents never are.
    let file = std::fs::File::create(dir.path().join("keys.txt")).unwrap();
    file.set_len((512 << 20) + 1).unwrap();
    let (code, _, stderr) = check(dir.path());
    assert_eq!(code, 1);
    assert!(
        stderr
            .trim_end()
            .ends_with("keys.txt: file is larger than 512 MiB"),
        "{stderr}"
    );
    // A YAML keys file has the same bound (a policy's is 64 MiB).
    let text = std::fs::read_to_string(dir.path().join("policy.yaml")).unwrap();
    std::fs::write(
        dir.path().join("policy.yaml"),
        text.replace("keys.txt", "keys.yaml"),
    )
    .unwrap();
    let file = std::fs::File::create(dir.path().join("keys.yaml")).unwrap();
    file.set_len((512 << 20) + 1).unwrap();
    let (code, _, stderr) = check(dir.path());
    assert_eq!(code, 1);
    assert!(
        stderr
            .trim_end()
            .ends_with("keys.yaml: file is larger than 512 MiB"),
        "{stderr}"
    );
    file.set_len((64 << 20) + 1).unwrap();
    let (code, _, stderr) = check(dir.path());
    assert_eq!(code, 1, "64 MiB of NUL bytes is no keys file");
    assert!(!stderr.contains("larger than"), "{stderr}");
}

#[test]
fn the_gateway_admits_a_key_of_the_file_and_only_those() {
    let dir = tempfile::tempdir().unwrap();
    let keys: String = (0..2_000)
        .map(|i| {
            format!(
                "{} ci-{i} tenant-{} {}\n",
                digest(&format!("key-{i}")),
                i % 7,
                if i % 2 == 0 { "pro" } else { "" }
            )
        })
        .collect();
    std::fs::write(dir.path().join("keys.txt"), keys).unwrap();
    let keys_path = dir.path().join("keys.txt");
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}" }}
auth: {{ keys_file: "{}" }}
plans: {{ pro: {{}} }}
routes:
  - {{ name: r, path: /, respond: {{ status: 200 }} }}
"#,
        keys_path.display()
    );
    let gw = Gateway::start(&policy, None);
    for i in [0, 1, 999, 1_999] {
        let auth = format!("Bearer key-{i}");
        assert_eq!(
            gw.get("/", &[("authorization", &auth)]).status,
            200,
            "key-{i}"
        );
    }
    for key in ["key-2000", "key-", "ci-1"] {
        let auth = format!("Bearer {key}");
        assert_eq!(
            gw.get("/", &[("authorization", &auth)]).status,
            401,
            "{key}"
        );
    }
}

/// The gateway's resident set, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[test]
fn an_idle_gateway_hands_back_the_replaced_keys_after_a_reload() {
    // Enough keys that the table dominates the process: two copies
    // resident would be far above one.
    let dir = tempfile::tempdir().unwrap();
    let keys: String = (0..300_000)
        .map(|i| format!("{} ci-{i} tenant-{}\n", digest(&format!("key-{i}")), i % 97))
        .collect();
    let keys_path = dir.path().join("keys.txt");
    std::fs::write(&keys_path, keys).unwrap();
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}" }}
auth: {{ keys_file: "{}" }}
routes:
  - {{ name: r, path: /, respond: {{ status: 200 }} }}
"#,
        keys_path.display()
    );
    let empty = Gateway::start(
        &policy.replace(&keys_path.display().to_string(), "/dev/null"),
        None,
    );
    let base = rss_kib(empty.pid());
    drop(empty);
    let gw = Gateway::start(&policy, None);
    let loaded = rss_kib(gw.pid());
    let table = loaded.saturating_sub(base);
    assert!(
        table > 30 * 1024,
        "the keys cost {table} KiB; too few to tell copies apart"
    );
    for round in 1..=2 {
        gw.signal("-HUP");
        let reloaded = support::eventually(Duration::from_secs(60), || {
            gw.metric("tollgate_config_reloads_total{result=\"ok\"}") >= f64::from(round)
        });
        // (Once seen in a full suite on a busy machine: no reload within a
        // minute. What the gateway says then is what tells why.)
        assert!(
            reloaded,
            "reload {round} not seen: {:?}; log: {}",
            gw.metrics()
                .lines()
                .filter(|l| l.starts_with("tollgate_config_reload"))
                .collect::<Vec<_>>(),
            gw.log()
        );
        // Nothing is sent: an idle gateway's allocator would keep the old
        // table's pages until its next request.
        let mut now = 0;
        let settled = support::eventually(Duration::from_secs(30), || {
            now = rss_kib(gw.pid());
            now < loaded + table / 2
        });
        assert!(
            settled,
            "reload {round}: {now} KiB resident, one table is {table} KiB above {base} KiB"
        );
    }
    assert_eq!(
        gw.get("/", &[("authorization", "Bearer key-299999")])
            .status,
        200
    );
}
