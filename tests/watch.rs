//! Reload on change (`server.watch`, on by default): the gateway picks up a
//! policy rewritten in place, replaced by rename, or swapped by a symlink
//! the way Kubernetes updates a mounted ConfigMap, and a keys file change;
//! a broken write keeps the last good policy and counts an error.

mod support;

use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use support::{digest, eventually, Gateway};

/// Generous: the contract is a second or two, the machine may be busy.
const WAIT: Duration = Duration::from_secs(20);

fn policy(version: &str, capacity: u32) -> String {
    format!(
        r#"
version: 1
policy_version: "{version}"
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
auth:
  keys:
    - {{ id: c1, tenant: acme, sha256: "{}" }}
    - {{ id: c2, tenant: acme, sha256: "{}" }}
limits:
  per-credential: {{ key: [credential], capacity: {capacity}, refill_per_second: 0.001 }}
routes:
  - {{ name: r, path: /, respond: {{ status: 200 }}, limits: [per-credential] }}
"#,
        digest("k1"),
        digest("k2"),
    )
}

/// The policy as the gateway would read it from `gw`'s file.
fn text_for(gw: &Gateway, policy: &str) -> String {
    policy
        .replace("{listen}", &gw.addr.to_string())
        .replace("{admin}", &gw.admin.to_string())
}

fn admitted(gw: &Gateway, key: &str, tries: u32) -> u32 {
    let auth = format!("Bearer {key}");
    (0..tries)
        .filter(|_| gw.get("/", &[("authorization", auth.as_str())]).status == 200)
        .count() as u32
}

fn serves(gw: &Gateway, version: &str) -> bool {
    gw.metric(&format!(
        "tollgate_config_info{{policy_version=\"{version}\"}}"
    )) == 1.0
}

const OK: &str = "tollgate_config_reloads_total{result=\"ok\"}";
const ERROR: &str = "tollgate_config_reloads_total{result=\"error\"}";

#[test]
fn a_policy_rewritten_in_place_is_reloaded() {
    let gw = Gateway::start(&policy("v1", 2), None);
    assert_eq!(admitted(&gw, "k1", 4), 2);
    gw.rewrite(&policy("v2", 5), None);
    assert!(eventually(WAIT, || serves(&gw, "v2")), "{}", gw.log());
    assert_eq!(admitted(&gw, "k2", 7), 5, "the new limits apply");
}

#[test]
fn an_editors_write_rename_and_chmod_are_one_reload() {
    let gw = Gateway::start(&policy("v1", 2), None);
    let saved = gw.config.with_extension("yaml.swp");
    std::fs::write(&saved, text_for(&gw, &policy("v2", 5))).unwrap();
    std::fs::rename(&saved, &gw.config).unwrap();
    std::fs::set_permissions(&gw.config, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(eventually(WAIT, || serves(&gw, "v2")), "{}", gw.log());
    assert_eq!(admitted(&gw, "k2", 7), 5);
    // Whatever else the directory hears, the content is the same: no
    // reload more.
    std::fs::write(gw.config.with_extension("other"), "x").unwrap();
    std::fs::set_permissions(&gw.config, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(gw.metric(OK), 1.0, "{}", gw.log());
}

/// The layout of a mounted ConfigMap: `tollgate.yaml` → `..data/tollgate.yaml`,
/// `..data` → a timestamped directory.
fn configmap(dir: &Path, text: &str) -> PathBuf {
    let first = dir.join("..2026_12_03_10_00_00.000000001");
    std::fs::create_dir(&first).unwrap();
    std::fs::write(first.join("tollgate.yaml"), text).unwrap();
    symlink(first.file_name().unwrap(), dir.join("..data")).unwrap();
    symlink("..data/tollgate.yaml", dir.join("tollgate.yaml")).unwrap();
    dir.join("tollgate.yaml")
}

/// What the kubelet does on an update: a new timestamped directory, a new
/// link renamed over `..data`, the old directory deleted.
fn configmap_update(dir: &Path, stamp: &str, text: &str) {
    let old = std::fs::read_link(dir.join("..data")).unwrap();
    let new = dir.join(format!("..2026_12_03_10_00_{stamp}.000000001"));
    std::fs::create_dir(&new).unwrap();
    std::fs::write(new.join("tollgate.yaml"), text).unwrap();
    symlink(new.file_name().unwrap(), dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    std::fs::remove_dir_all(dir.join(old)).unwrap();
}

#[test]
fn a_configmap_swapped_by_symlink_is_reloaded_each_time() {
    let gw = Gateway::start_placed(&policy("v1", 2), None, &[], &configmap);
    let dir = gw.config.parent().unwrap().to_path_buf();
    configmap_update(&dir, "01", &text_for(&gw, &policy("v2", 5)));
    assert!(eventually(WAIT, || serves(&gw, "v2")), "{}", gw.log());
    assert_eq!(admitted(&gw, "k1", 7), 5);
    // The first directory is gone: the watch is on the mount, not on it.
    configmap_update(&dir, "02", &text_for(&gw, &policy("v3", 1)));
    assert!(eventually(WAIT, || serves(&gw, "v3")), "{}", gw.log());
    assert_eq!(admitted(&gw, "k2", 3), 1);
}

/// The policy one directory down, in `conf/`.
fn nested(dir: &Path, text: &str) -> PathBuf {
    std::fs::create_dir(dir.join("conf")).unwrap();
    std::fs::write(dir.join("conf/policy.yaml"), text).unwrap();
    dir.join("conf/policy.yaml")
}

#[test]
fn a_directory_removed_and_made_again_is_watched_again() {
    let gw = Gateway::start_placed(&policy("v1", 2), None, &[], &nested);
    let conf = gw.config.parent().unwrap();
    std::fs::remove_dir_all(conf).unwrap();
    std::fs::create_dir(conf).unwrap();
    std::fs::write(&gw.config, text_for(&gw, &policy("v2", 5))).unwrap();
    assert!(eventually(WAIT, || serves(&gw, "v2")), "{}", gw.log());
    // And the new directory is the one heard from now.
    std::fs::write(&gw.config, text_for(&gw, &policy("v3", 1))).unwrap();
    assert!(eventually(WAIT, || serves(&gw, "v3")), "{}", gw.log());
    assert_eq!(admitted(&gw, "k1", 3), 1);
}

/// A file written through another link of it, as a file bind-mounted
/// into a container is written on the host: its directory's watch hears
/// nothing, the periodic look at each file's size and time does.
#[test]
fn a_file_written_through_another_link_is_reloaded() {
    let gw = Gateway::start(&policy("v1", 2), None);
    let elsewhere = tempfile::tempdir().unwrap();
    let link = elsewhere.path().join("policy.yaml");
    std::fs::hard_link(&gw.config, &link).unwrap();
    std::fs::write(&link, text_for(&gw, &policy("v2", 5))).unwrap();
    assert!(eventually(WAIT, || serves(&gw, "v2")), "{}", gw.log());
    assert_eq!(admitted(&gw, "k1", 7), 5);
}

#[test]
fn a_broken_write_keeps_the_last_good_policy_and_counts_an_error() {
    let gw = Gateway::start(&policy("v1", 2), None);
    gw.rewrite(
        &policy("v2", 5).replace("refill_per_second", "refill_per_secnd"),
        None,
    );
    assert!(eventually(WAIT, || gw.metric(ERROR) >= 1.0), "{}", gw.log());
    assert!(serves(&gw, "v1"));
    assert_eq!(admitted(&gw, "k1", 4), 2, "still policy v1");
    // A half-written file is as broken; the next good one goes live.
    let whole = policy("v3", 3);
    gw.rewrite(&whole[..whole.len() / 2], None);
    assert!(eventually(WAIT, || gw.metric(ERROR) >= 2.0), "{}", gw.log());
    assert!(serves(&gw, "v1"));
    gw.rewrite(&whole, None);
    assert!(eventually(WAIT, || serves(&gw, "v3")), "{}", gw.log());
    assert_eq!(gw.metric(OK), 1.0);
}

#[test]
fn a_keys_file_change_adds_a_credential() {
    let keys_dir = tempfile::tempdir().unwrap();
    let keys = keys_dir.path().join("keys.yaml");
    let entry = |id: &str, raw: &str| {
        format!(
            "  - {{ id: {id}, tenant: acme, sha256: \"{}\" }}\n",
            digest(raw)
        )
    };
    std::fs::write(&keys, format!("keys:\n{}", entry("c1", "k1"))).unwrap();
    let text = format!(
        "version: 1\nserver: {{ listen: [\"{{listen}}\"], admin_listen: \"{{admin}}\", threads: 1 }}\n\
         auth: {{ keys_file: \"{}\" }}\nroutes:\n  - {{ name: r, path: /, respond: {{ status: 200 }} }}\n",
        keys.display()
    );
    let gw = Gateway::start(&text, None);
    assert_eq!(admitted(&gw, "k-new", 1), 0);
    std::fs::write(
        &keys,
        format!("keys:\n{}{}", entry("c1", "k1"), entry("c9", "k-new")),
    )
    .unwrap();
    assert!(
        eventually(WAIT, || admitted(&gw, "k-new", 1) == 1),
        "{}",
        gw.log()
    );
    assert_eq!(admitted(&gw, "k1", 1), 1);
}

#[test]
fn with_watch_off_a_change_waits_for_a_reload() {
    let off = |v: &str| policy(v, 2).replace("threads: 1", "threads: 1, watch: false");
    let gw = Gateway::start(&off("v1"), None);
    gw.rewrite(&off("v2"), None);
    std::thread::sleep(Duration::from_secs(2));
    assert!(serves(&gw, "v1"));
    gw.signal("-HUP");
    assert!(eventually(WAIT, || serves(&gw, "v2")));
}
