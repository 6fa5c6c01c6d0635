//! JWT callers end to end: keys generated here (RSA and EC, two `kid`s, a
//! rotation), tokens signed here, the gateway admitting the valid ones
//! with the claims as the caller and refusing each broken one with 401
//! and its reason counted.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use support::{eventually, Gateway};

const MAIN: &str = "https://auth.example.com/";
const ADMIN_TOKEN: &str = "oncall-s3cret";
const PARTNER: &str = "https://partner.example.net/";

/// A private key made by openssl, PKCS#8 PEM.
fn private_key(dir: &Path, name: &str, args: &[&str]) -> Vec<u8> {
    let file = dir.join(name);
    let status = Command::new("openssl")
        .args(["genpkey", "-out"])
        .arg(&file)
        .args(args)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl");
    assert!(status.success());
    std::fs::read(file).unwrap()
}

struct Signer {
    kid: &'static str,
    alg: Algorithm,
    key: EncodingKey,
    pem: Vec<u8>,
}

impl Signer {
    fn rsa(dir: &Path, kid: &'static str) -> Self {
        let pem = private_key(
            dir,
            kid,
            &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
        );
        Self {
            kid,
            alg: Algorithm::RS256,
            key: EncodingKey::from_rsa_pem(&pem).unwrap(),
            pem,
        }
    }

    fn ec(dir: &Path, kid: &'static str) -> Self {
        let pem = private_key(
            dir,
            kid,
            &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
        );
        Self {
            kid,
            alg: Algorithm::ES256,
            key: EncodingKey::from_ec_pem(&pem).unwrap(),
            pem,
        }
    }

    fn jwk(&self) -> Jwk {
        let mut jwk = Jwk::from_encoding_key(&self.key, self.alg).unwrap();
        jwk.common.key_id = Some(self.kid.into());
        jwk
    }

    fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.into());
        jsonwebtoken::encode(&header, claims, &self.key).unwrap()
    }
}

fn write_jwks(path: &Path, signers: &[&Signer]) {
    let set = JwkSet {
        keys: signers.iter().map(|s| s.jwk()).collect(),
    };
    std::fs::write(path, serde_json::to_vec(&set).unwrap()).unwrap();
}

fn now() -> u64 {
    tollgate::clock::wall_ms() / 1000
}

fn claims(iss: &str, sub: &str, org: &str) -> Value {
    json!({ "iss": iss, "aud": "api.example.com", "sub": sub, "org_id": org, "exp": now() + 600 })
}

fn policy(dir: &Path) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", access_log: {{ path: "{log}" }}, admin_tokens: [{{ name: oncall, sha256: "{admin}", role: write }}] }}
plans: {{ gold: {{}} }}
auth:
  jwt:
    - {{ name: main, issuer: "{MAIN}", audiences: [api.example.com], jwks_file: "{main}",
        algorithms: [RS256, ES256], tenant_claim: org_id, plan_claim: plan }}
    - {{ name: partner, issuer: "{PARTNER}", audiences: [api.example.com], jwks_file: "{partner}",
        algorithms: [ES256], tenant_claim: org_id, tenant_prefix: "partner:" }}
routes:
  - {{ name: r, path: /, respond: {{ status: 200 }} }}
"#,
        log = dir.join("access.jsonl").display(),
        admin = support::digest(ADMIN_TOKEN),
        main = dir.join("main.json").display(),
        partner = dir.join("partner.json").display(),
    )
}

fn status(gw: &Gateway, token: &str) -> u16 {
    gw.get("/", &[("authorization", &format!("Bearer {token}"))])
        .status
}

fn failures(gw: &Gateway, reason: &str) -> f64 {
    gw.metric(&format!(
        "tollgate_auth_failures_total{{reason=\"{reason}\"}}"
    ))
}

/// The access log's lines so far, once `n` are written.
fn log_lines(dir: &Path, n: usize) -> Vec<Value> {
    let path = dir.join("access.jsonl");
    let read = || -> Vec<Value> {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert!(eventually(Duration::from_secs(5), || read().len() >= n));
    read()
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

#[test]
fn valid_tokens_name_their_caller_and_broken_ones_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let rsa = Signer::rsa(dir.path(), "rsa-1");
    let ec = Signer::ec(dir.path(), "ec-1");
    let partner = Signer::ec(dir.path(), "partner-1");
    write_jwks(&dir.path().join("main.json"), &[&rsa, &ec]);
    write_jwks(&dir.path().join("partner.json"), &[&partner]);
    let gw = Gateway::start(&policy(dir.path()), None);

    // Valid: RSA and EC, a plan claim, and two issuers with the same org_id.
    let mut gold = claims(MAIN, "alice", "acme");
    gold["plan"] = json!("gold");
    assert_eq!(status(&gw, &rsa.sign(&gold)), 200);
    assert_eq!(status(&gw, &ec.sign(&claims(MAIN, "bob", "acme"))), 200);
    assert_eq!(
        status(&gw, &partner.sign(&claims(PARTNER, "alice", "acme"))),
        200
    );
    let lines = log_lines(dir.path(), 3);
    let who: Vec<_> = lines
        .iter()
        .map(|l| {
            (
                l["credential"].clone(),
                l["tenant"].clone(),
                l["auth_source"].clone(),
            )
        })
        .collect();
    assert_eq!(
        who,
        [
            (json!("jwt:main:alice"), json!("acme"), json!("jwt")),
            (json!("jwt:main:bob"), json!("acme"), json!("jwt")),
            (
                json!("jwt:partner:alice"),
                json!("partner:acme"),
                json!("jwt")
            ),
        ]
    );

    // Each broken token: 401 and its reason.
    let mut expired = claims(MAIN, "alice", "acme");
    expired["exp"] = json!(now() - 3600);
    let mut early = claims(MAIN, "alice", "acme");
    early["nbf"] = json!(now() + 3600);
    let mut no_exp = claims(MAIN, "alice", "acme");
    no_exp.as_object_mut().unwrap().remove("exp");
    let mut audience = claims(MAIN, "alice", "acme");
    audience["aud"] = json!("other.example.com");
    let mut huge = claims(MAIN, "alice", "acme");
    huge["pad"] = json!("x".repeat(9_000));
    let mut long_sub = claims(MAIN, &"a".repeat(300), "acme");
    long_sub["x"] = json!(1);
    // Issued by the partner's name but signed with a main key: the kid is
    // not the partner's.
    let crossed = rsa.sign(&claims(PARTNER, "mallory", "acme"));
    // The payload changed after signing.
    let good = rsa.sign(&claims(MAIN, "alice", "acme"));
    let parts: Vec<&str> = good.split('.').collect();
    let tampered = format!(
        "{}.{}.{}",
        parts[0],
        b64(serde_json::to_vec(&claims(MAIN, "root", "acme"))
            .unwrap()
            .as_slice()),
        parts[2]
    );
    // alg none, and HS256 keyed with the RSA public key's PEM.
    let none = format!(
        "{}.{}.",
        b64(br#"{"alg":"none","kid":"rsa-1"}"#),
        b64(serde_json::to_vec(&claims(MAIN, "root", "acme"))
            .unwrap()
            .as_slice())
    ) + "x";
    let public = Command::new("openssl")
        .args(["pkey", "-pubout"])
        .arg("-in")
        .arg(dir.path().join("rsa-1"))
        .output()
        .unwrap()
        .stdout;
    let mut hs = Header::new(Algorithm::HS256);
    hs.kid = Some("rsa-1".into());
    let hmac = jsonwebtoken::encode(
        &hs,
        &claims(MAIN, "root", "acme"),
        &EncodingKey::from_secret(&public).unwrap(),
    )
    .unwrap();
    let cases = [
        ("expired", rsa.sign(&expired)),
        ("bad_claims", rsa.sign(&early)),
        ("bad_claims", rsa.sign(&no_exp)),
        ("bad_claims", rsa.sign(&audience)),
        ("bad_claims", rsa.sign(&huge)),
        ("bad_claims", rsa.sign(&long_sub)),
        ("bad_claims", rsa.sign(&claims(MAIN, "tab\tbed", "acme"))),
        ("bad_claims", rsa.sign(&claims(MAIN, "root", "acmé"))),
        ("unknown", crossed),
        ("bad_signature", tampered),
        ("bad_signature", none),
        ("bad_signature", hmac),
    ];
    for (reason, token) in &cases {
        let before = failures(&gw, reason);
        assert_eq!(status(&gw, token), 401, "{reason}: {token:.80}");
        assert_eq!(failures(&gw, reason), before + 1.0, "{reason}: {token:.80}");
    }
    // A JWT that fails is never tried as an API key: nothing else counted.
    assert_eq!(failures(&gw, "unknown"), 1.0);
    let _ = (&rsa.pem, &ec.pem);
}

#[test]
fn a_rotated_jwks_is_read_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let old = Signer::ec(dir.path(), "2026-11");
    let new = Signer::ec(dir.path(), "2026-12");
    let partner = Signer::ec(dir.path(), "partner-1");
    write_jwks(&dir.path().join("main.json"), &[&old]);
    write_jwks(&dir.path().join("partner.json"), &[&partner]);
    let gw = Gateway::start(&policy(dir.path()), None);
    let (by_old, by_new) = (
        old.sign(&claims(MAIN, "a", "t")),
        new.sign(&claims(MAIN, "a", "t")),
    );
    assert_eq!((status(&gw, &by_old), status(&gw, &by_new)), (200, 401));
    // Both keys during the rotation, then only the new one.
    write_jwks(&dir.path().join("main.json"), &[&old, &new]);
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(5), || status(&gw, &by_new) == 200));
    assert_eq!(status(&gw, &by_old), 200);
    write_jwks(&dir.path().join("main.json"), &[&new]);
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(5), || status(&gw, &by_old) == 401));
    assert_eq!(status(&gw, &by_new), 200);
}

#[test]
fn explain_names_a_jwt_caller_read_from_stdin() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let rsa = Signer::rsa(dir.path(), "rsa-1");
    let partner = Signer::ec(dir.path(), "partner-1");
    write_jwks(&dir.path().join("main.json"), &[&rsa]);
    write_jwks(&dir.path().join("partner.json"), &[&partner]);
    let text = policy(dir.path()).replace(
        "server: { listen: [\"{listen}\"], admin_listen: \"{admin}\", access_log: { path: \"",
        "# server: { access_log: { path: \"",
    );
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, text).unwrap();
    let mut gold = claims(MAIN, "alice", "acme");
    gold["plan"] = json!("gold");
    let explain = |token: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["explain", "--path", "/", "--key", "-", "--config"])
            .arg(&file)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(token.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (stdout, stderr) = explain(&rsa.sign(&gold));
    assert!(
        stdout
            .contains("caller: credential jwt:main:alice of tenant acme (from a JWT), plan gold\n"),
        "{stdout}{stderr}"
    );
    let mut expired = gold.clone();
    expired["exp"] = json!(now() - 3600);
    let (stdout, stderr) = explain(&rsa.sign(&expired));
    assert_eq!(stdout, "");
    assert_eq!(
        stderr.trim_end(),
        "tollgate: the JWT on stdin is refused (expired)"
    );
}

/// A JWKS endpoint: serves `body` while `up`, 503 otherwise; counts its
/// requests.
struct JwksServer {
    addr: std::net::SocketAddr,
    body: std::sync::Arc<std::sync::Mutex<String>>,
    up: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hits: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl JwksServer {
    fn start(body: String) -> Self {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = JwksServer {
            addr: listener.local_addr().unwrap(),
            body: std::sync::Arc::new(std::sync::Mutex::new(body)),
            up: std::sync::Arc::new(true.into()),
            hits: std::sync::Arc::default(),
        };
        let (body, up, hits) = (server.body.clone(), server.up.clone(), server.hits.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                hits.fetch_add(1, Ordering::SeqCst);
                let reply = if up.load(Ordering::SeqCst) {
                    let body = body.lock().unwrap().clone();
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into()
                };
                let _ = conn.write_all(reply.as_bytes());
            }
        });
        server
    }

    fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn jwks_json(signers: &[&Signer]) -> String {
    serde_json::to_string(&JwkSet {
        keys: signers.iter().map(|s| s.jwk()).collect(),
    })
    .unwrap()
}

/// A gateway whose main issuer's keys come from a [`JwksServer`] serving
/// `first`, fetched every `refresh_s`.
fn url_gateway(dir: &Path, refresh_s: u64, first: &Signer) -> (JwksServer, Gateway) {
    let partner = Signer::ec(dir, "partner-1");
    write_jwks(&dir.join("partner.json"), &[&partner]);
    let server = JwksServer::start(jwks_json(&[first]));
    let text = policy(dir).replace(
        &format!("jwks_file: \"{}\"", dir.join("main.json").display()),
        &format!(
            "jwks_url: \"http://{}/jwks.json\", refresh_s: {refresh_s}",
            server.addr
        ),
    );
    let gw = Gateway::start(&text, None);
    (server, gw)
}

#[test]
fn keys_fetched_from_a_url_follow_rotation_and_outlive_a_failing_endpoint_and_a_reload() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let a = Signer::ec(dir.path(), "a");
    let b = Signer::ec(dir.path(), "b");
    let (server, gw) = url_gateway(dir.path(), 1, &a);
    let (by_a, by_b) = (
        a.sign(&claims(MAIN, "a", "t")),
        b.sign(&claims(MAIN, "b", "t")),
    );
    assert!(eventually(Duration::from_secs(10), || status(&gw, &by_a) == 200));
    assert_eq!(status(&gw, &by_b), 401);
    // A new key published: fetched on refresh.
    *server.body.lock().unwrap() = jwks_json(&[&a, &b]);
    assert!(eventually(Duration::from_secs(10), || status(&gw, &by_b) == 200));
    // The endpoint fails: fetches go on failing, the keys stay.
    server.up.store(false, Ordering::SeqCst);
    let hits = server.hits();
    assert!(eventually(Duration::from_secs(10), || server.hits() >= hits + 2));
    assert_eq!((status(&gw, &by_a), status(&gw, &by_b)), (200, 200));
    // A reload while the endpoint is down keeps the last good set too.
    let ok = "tollgate_config_reloads_total{result=\"ok\"}";
    let reloads = gw.metric(ok);
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(10), || gw.metric(ok) > reloads));
    assert_eq!((status(&gw, &by_a), status(&gw, &by_b)), (200, 200));
}

#[test]
fn a_jwks_url_must_not_carry_keys_in_the_clear() {
    let dir = tempfile::tempdir().unwrap();
    let partner = Signer::ec(dir.path(), "partner-1");
    write_jwks(&dir.path().join("partner.json"), &[&partner]);
    let text = policy(dir.path())
        .replace(
            &format!("jwks_file: \"{}\"", dir.path().join("main.json").display()),
            "jwks_url: \"http://auth.example.com/jwks.json\"",
        )
        .replace(
            "server: { listen: [\"{listen}\"], admin_listen: \"{admin}\", access_log: { path: \"",
            "# server: { access_log: { path: \"",
        );
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .trim_end()
            .ends_with("auth.jwt[0].jwks_url: must be https://, or http:// to a loopback address"),
        "{stderr}"
    );
}

#[test]
fn a_token_with_a_new_kid_fetches_the_keys_without_waiting_for_the_refresh() {
    let dir = tempfile::tempdir().unwrap();
    let a = Signer::ec(dir.path(), "a");
    let b = Signer::ec(dir.path(), "b");
    let (server, gw) = url_gateway(dir.path(), 3600, &a);
    let by_a = a.sign(&claims(MAIN, "a", "t"));
    assert!(eventually(Duration::from_secs(10), || status(&gw, &by_a) == 200));
    assert_eq!(server.hits(), 1, "fetched once at start");
    // The issuer starts signing with a new key: the first token naming it
    // is refused and asks for a fetch; the keys arrive within the hour's
    // refresh.
    *server.body.lock().unwrap() = jwks_json(&[&a, &b]);
    let by_b = b.sign(&claims(MAIN, "b", "t"));
    assert_eq!(status(&gw, &by_b), 401);
    assert!(eventually(Duration::from_secs(10), || status(&gw, &by_b) == 200));
    // Tokens with kids nobody publishes do not make the gateway fetch again
    // and again (at most once every 10 s).
    let c = Signer::ec(dir.path(), "c");
    let by_c = c.sign(&claims(MAIN, "c", "t"));
    for _ in 0..20 {
        assert_eq!(status(&gw, &by_c), 401);
    }
    assert!(server.hits() <= 3, "{} fetches", server.hits());
}

#[test]
fn a_jwt_caller_is_revoked_by_its_credential_id() {
    let dir = tempfile::tempdir().unwrap();
    let ec = Signer::ec(dir.path(), "ec-1");
    let partner = Signer::ec(dir.path(), "partner-1");
    write_jwks(&dir.path().join("main.json"), &[&ec]);
    write_jwks(&dir.path().join("partner.json"), &[&partner]);
    let gw = Gateway::start(&policy(dir.path()), None);
    let (alice, bob) = (
        ec.sign(&claims(MAIN, "alice", "acme")),
        ec.sign(&claims(MAIN, "bob", "acme")),
    );
    assert_eq!((status(&gw, &alice), status(&gw, &bob)), (200, 200));
    let revoke = |credential: &str| {
        let body =
            json!({ "credential": credential, "expires_in_s": 3600, "reason": "token leaked" });
        let auth = format!("Bearer {ADMIN_TOKEN}");
        support::request_with_body(
            gw.admin,
            "POST",
            "/admin/revocations",
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body.to_string().as_bytes(),
        )
        .status
    };
    assert_eq!(revoke("jwt:main:alice"), 201);
    assert!(eventually(Duration::from_secs(5), || status(&gw, &alice) == 401));
    assert_eq!(status(&gw, &bob), 200, "only alice");
    assert_eq!(failures(&gw, "revoked"), 1.0);
    // Names outside the issuers' spaces are refused.
    assert_eq!(revoke("jwt:nobody:alice"), 404);
    assert_eq!(revoke("jwt:main:"), 404);
}

#[test]
fn forged_tokens_beyond_the_ip_guard_cost_no_signature_check() {
    let dir = tempfile::tempdir().unwrap();
    let ec = Signer::ec(dir.path(), "ec-1");
    let forger = Signer::ec(dir.path(), "ec-1");
    write_jwks(&dir.path().join("main.json"), &[&ec]);
    write_jwks(&dir.path().join("partner.json"), &[&ec]);
    let text = policy(dir.path()).replace(
        "routes:\n  - { name: r, path: /, respond: { status: 200 } }",
        "limits:\n  guard: { scope: pre_auth, key: [ip], capacity: 5, refill_per_second: 0.001 }\n\
         routes:\n  - { name: r, path: /, respond: { status: 200 }, limits: [guard] }",
    );
    assert!(text.contains("limits: [guard]"));
    let gw = Gateway::start(&text, None);
    // Same `kid`, another key: every signature fails.
    let forged = forger.sign(&claims(MAIN, "mallory", "acme"));
    let statuses: Vec<u16> = (0..40).map(|_| status(&gw, &forged)).collect();
    assert_eq!(
        statuses.iter().filter(|&&s| s == 401).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|&&s| s == 429).count(),
        35,
        "{statuses:?}"
    );
    // Only the five the guard let through were checked, and counted.
    assert_eq!(failures(&gw, "bad_signature"), 5.0, "{}", gw.metrics());
    assert_eq!(
        gw.metric("tollgate_auth_lookups_total{result=\"miss\",source=\"jwt\"}"),
        5.0
    );
}

#[test]
fn a_claim_keys_a_limit_per_value() {
    let dir = tempfile::tempdir().unwrap();
    let rsa = Signer::rsa(dir.path(), "rsa-1");
    write_jwks(&dir.path().join("main.json"), &[&rsa]);
    write_jwks(&dir.path().join("partner.json"), &[&rsa]);
    let policy = policy(dir.path()).replace(
        "routes:\n",
        "limits:\n  per-project: { key: [claim.project], capacity: 2, refill_per_second: 0.001, absent: reject }\nroutes:\n  - { name: claimed, path: /claimed, respond: { status: 200 }, limits: [per-project] }\n",
    );
    let gw = Gateway::start(&policy, None);
    let token = |sub: &str, project: Value| {
        let mut c = claims(MAIN, sub, "acme");
        c["project"] = project;
        rsa.sign(&c)
    };
    let call = |token: &str| {
        gw.get("/claimed", &[("authorization", &format!("Bearer {token}"))])
            .status
    };
    // Two callers of one project share its budget; an integer claim reads
    // as its decimal form.
    assert_eq!(call(&token("alice", json!("p1"))), 200);
    assert_eq!(call(&token("bob", json!("p1"))), 200);
    assert_eq!(call(&token("alice", json!("p1"))), 429);
    assert_eq!(call(&token("alice", json!(7))), 200);
    assert_eq!(call(&token("bob", json!(7))), 200);
    assert_eq!(call(&token("carol", json!(7))), 429);
    // A claim that is absent (or not a string or integer) is refused.
    assert_eq!(call(&token("alice", json!(1.5))), 400);
    assert_eq!(call(&rsa.sign(&claims(MAIN, "alice", "acme"))), 400);
}
