//! Test helpers: the real `tollgate` binary on free loopback ports, a real
//! upstream HTTP server that echoes what it received, and a minimal HTTP/1.1
//! client that can connect from a chosen loopback address.
#![allow(dead_code)]

pub mod redis_server;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

/// A free TCP port on 127.0.0.1 (bound, then released), never the same
/// one twice in a test process: the system may hand a just-released port
/// to the next caller, and tests run in parallel.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// What an upstream has seen, shared with its connection threads.
#[derive(Default)]
pub struct UpstreamState {
    pub hits: AtomicUsize,
    pub in_flight: AtomicUsize,
    pub max_in_flight: AtomicUsize,
    /// Milliseconds to wait before answering paths under `/slow`.
    pub delay_ms: AtomicUsize,
    /// What `/health` answers: 200 while true, 500 otherwise.
    pub unhealthy: std::sync::atomic::AtomicBool,
}

/// An upstream that answers with 200 and a JSON echo of the method, path,
/// headers and body it received. `/slow…` waits `delay_ms` first, `/fail…`
/// closes the connection without an answer, `/health` reports the
/// `unhealthy` flag. It counts requests and the most it had at once.
pub struct Upstream {
    pub addr: SocketAddr,
    pub state: Arc<UpstreamState>,
}

impl Upstream {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpstreamState::default());
        let shared = state.clone();
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let state = shared.clone();
                thread::spawn(move || serve(conn, &state));
            }
        });
        Self { addr, state }
    }

    pub fn slow(delay: Duration) -> Self {
        let u = Self::start();
        u.state
            .delay_ms
            .store(delay.as_millis() as usize, Ordering::SeqCst);
        u
    }

    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }
}

fn serve(conn: TcpStream, state: &UpstreamState) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    let mut conn = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (
            parts.next().unwrap_or("").to_string(),
            parts.next().unwrap_or("").to_string(),
        );
        let mut headers = serde_json::Map::new();
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
                if k == "content-length" {
                    length = v.parse().unwrap_or(0);
                }
                let slot = headers
                    .entry(k)
                    .or_insert_with(|| serde_json::Value::Array(vec![]));
                slot.as_array_mut().unwrap().push(v.into());
            }
        }
        let chunked = headers
            .get("transfer-encoding")
            .is_some_and(|v| v.to_string().contains("chunked"));
        let body = if chunked {
            match read_chunked(&mut reader) {
                Some(body) => body,
                None => return,
            }
        } else {
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                return;
            }
            body
        };
        if path == "/health" {
            let status = if state.unhealthy.load(Ordering::SeqCst) {
                "500 Oops"
            } else {
                "200 OK"
            };
            let _ = conn.write_all(
                format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .as_bytes(),
            );
            return;
        }
        state.hits.fetch_add(1, Ordering::SeqCst);
        let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if path.starts_with("/slow") {
            thread::sleep(Duration::from_millis(
                state.delay_ms.load(Ordering::SeqCst) as u64
            ));
        }
        state.in_flight.fetch_sub(1, Ordering::SeqCst);
        if path.starts_with("/fail") {
            return;
        }
        if path.ends_with("/big") {
            // A response larger than any socket buffer, for clients that stop reading.
            let body = vec![b'x'; 64 << 20];
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
            if conn.write_all(head.as_bytes()).is_err() || conn.write_all(&body).is_err() {
                return;
            }
            continue;
        }
        // A usage to report, as an LLM API reports the tokens it spent.
        let usage = headers
            .get("x-reply-usage")
            .and_then(|v| v[0].as_str())
            .map(|n| format!("x-usage-tokens: {n}\r\n"))
            .unwrap_or_default();
        let body = String::from_utf8_lossy(&body);
        let echo =
            serde_json::json!({ "method": method, "path": path, "headers": headers, "body": body })
                .to_string();
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{usage}content-length: {}\r\n\r\n{echo}",
            echo.len()
        );
        if conn.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// A chunked body, its trailers skipped.
fn read_chunked(reader: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).ok()?;
        let size = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
        if size == 0 {
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).ok()? == 0 || line.trim().is_empty() {
                    return Some(body);
                }
            }
        }
        let start = body.len();
        body.resize(start + size + 2, 0);
        reader.read_exact(&mut body[start..]).ok()?;
        body.truncate(start + size);
    }
}

/// A response as the client saw it.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// Values of a request header as the upstream echo saw them.
    pub fn upstream_saw(&self, header: &str) -> Vec<String> {
        self.json()["headers"][header]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    }
}

/// One request on a fresh connection, optionally from a chosen local address.
pub fn request(
    to: SocketAddr,
    from: Option<IpAddr>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Reply {
    send(connect(to, from), method, path, headers, None)
}

/// One request with a body (its `content-length` added) on a fresh
/// connection.
pub fn request_with_body(
    to: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    send(connect(to, None), method, path, headers, Some(body))
}

fn send(
    mut stream: TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Reply {
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        req.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).expect("send");
    stream.write_all(body.unwrap_or_default()).expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read");
    parse(&raw)
}

/// Sends raw bytes on a fresh connection and reads until the gateway closes
/// it (or 10 s pass): what a raw socket sees.
pub fn raw(to: SocketAddr, bytes: &[u8]) -> String {
    let mut stream = connect(to, None);
    stream.write_all(bytes).expect("send");
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// The status of a raw HTTP/1.1 reply (0 for none).
pub fn status_of(reply: &str) -> u16 {
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

pub fn get(to: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    request(to, None, "GET", path, headers)
}

pub fn connect(to: SocketAddr, from: Option<IpAddr>) -> TcpStream {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    if let Some(ip) = from {
        socket
            .bind(&SocketAddr::new(ip, 0).into())
            .expect("bind client");
    }
    socket
        .connect_timeout(&to.into(), Duration::from_secs(5))
        .expect("connect");
    let stream: TcpStream = socket.into();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

pub fn parse(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {text}"));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    out
}

/// The addresses of `server.tls.listen` in the policy file at `config`:
/// that listener may start a moment after the others.
fn tls_listeners(config: &std::path::Path) -> Vec<SocketAddr> {
    let text = std::fs::read_to_string(config).unwrap_or_default();
    let Some(tls) = text.find("tls:") else {
        return Vec::new();
    };
    let rest = &text[tls..];
    let Some(list) = rest
        .find("listen:")
        .filter(|&at| at < 80)
        .and_then(|at| rest[at..].split_once('[')?.1.split_once(']'))
        .map(|(list, _)| list)
    else {
        return Vec::new();
    };
    list.split(',')
        .filter_map(|a| a.trim().trim_matches('"').parse().ok())
        .collect()
}

/// The real binary serving a policy; stopped on drop.
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub config: PathBuf,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Gateway {
    /// Starts `tollgate run` on a policy; `{listen}`, `{admin}` and
    /// `{upstream}` in the text are replaced by the chosen addresses.
    pub fn start(policy: &str, upstream: Option<&Upstream>) -> Self {
        Self::start_with_env(policy, upstream, &[])
    }

    /// As [`Gateway::start`], with extra environment variables.
    pub fn start_with_env(policy: &str, upstream: Option<&Upstream>, env: &[(&str, &str)]) -> Self {
        Self::start_placed(policy, upstream, env, &Self::place_plain)
    }

    /// As [`Gateway::start_with_env`], with the policy put in the gateway's
    /// directory by `place`, which returns the path the gateway is given.
    pub fn start_placed(
        policy: &str,
        upstream: Option<&Upstream>,
        env: &[(&str, &str)],
        place: &dyn Fn(&std::path::Path, &str) -> PathBuf,
    ) -> Self {
        // A port found free can be taken by another test before the gateway
        // binds it; the gateway then exits, and a new pair of ports is tried.
        let mut last_log = String::new();
        for _ in 0..5 {
            match Self::spawn(policy, upstream, env, place) {
                Ok(gw) => return gw,
                Err(log) => last_log = log,
            }
        }
        panic!("tollgate did not start: {last_log}");
    }

    fn spawn(
        policy: &str,
        upstream: Option<&Upstream>,
        env: &[(&str, &str)],
        place: &dyn Fn(&std::path::Path, &str) -> PathBuf,
    ) -> Result<Self, String> {
        let mut gw = Self::launch_placed(policy, upstream, env, place);
        gw.wait_ready()?;
        Ok(gw)
    }

    /// Starts `tollgate run` as [`Gateway::start_with_env`] does, without
    /// waiting for it to listen (nor retrying on a port taken meanwhile).
    pub fn launch(policy: &str, upstream: Option<&Upstream>, env: &[(&str, &str)]) -> Self {
        Self::launch_placed(policy, upstream, env, &Self::place_plain)
    }

    /// The policy as a plain file, `policy.yaml`, in `dir`.
    fn place_plain(dir: &std::path::Path, text: &str) -> PathBuf {
        let config = dir.join("policy.yaml");
        std::fs::write(&config, text).expect("write policy");
        config
    }

    fn launch_placed(
        policy: &str,
        upstream: Option<&Upstream>,
        env: &[(&str, &str)],
        place: &dyn Fn(&std::path::Path, &str) -> PathBuf,
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let upstream = upstream.map_or("127.0.0.1:9".to_string(), |u| u.addr.to_string());
        let text = policy
            .replace("{listen}", &addr.to_string())
            .replace("{admin}", &admin.to_string())
            .replace("{upstream}", &upstream);
        let config = place(dir.path(), &text);
        let log = std::fs::File::create(dir.path().join("gateway.log")).expect("log");
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["run", "--config"])
            .arg(&config)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tollgate");
        Gateway {
            addr,
            admin,
            config,
            child,
            _dir: dir,
        }
    }

    /// Waits for both listeners; the gateway's log when it exits instead.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = tollgate::clock::instant() + Duration::from_secs(20);
        while tollgate::clock::instant() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("tollgate exited with {status}: {}", self.log()));
            }
            let up = TcpStream::connect(self.addr).is_ok()
                && TcpStream::connect(self.admin).is_ok()
                && tls_listeners(&self.config)
                    .iter()
                    .all(|a| TcpStream::connect(a).is_ok());
            if up && get(self.admin, "/healthz", &[]).status == 200 {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(20));
        }
        panic!("tollgate did not become ready: {}", self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("gateway.log")).unwrap_or_default()
    }

    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        get(self.addr, path, headers)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (`-HUP`, `-TERM`…) to the gateway process.
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for the process to exit, at most `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = tollgate::clock::instant() + limit;
        while tollgate::clock::instant() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Replaces the policy file (placeholders as in [`Gateway::start`]).
    pub fn rewrite(&self, policy: &str, upstream: Option<&Upstream>) {
        let upstream = upstream.map_or("127.0.0.1:9".to_string(), |u| u.addr.to_string());
        let text = policy
            .replace("{listen}", &self.addr.to_string())
            .replace("{admin}", &self.admin.to_string())
            .replace("{upstream}", &upstream);
        std::fs::write(&self.config, text).expect("write policy");
    }

    /// The admin listener's `/metrics` text.
    pub fn metrics(&self) -> String {
        get(self.admin, "/metrics", &[]).body
    }

    /// The value of one series in `/metrics` (0 when absent).
    pub fn metric(&self, series: &str) -> f64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An admin request with a token and a JSON body, on its own connection.
pub fn admin_call(gw: &Gateway, method: &str, path: &str, token: &str, body: &str) -> Reply {
    let auth = format!("Bearer {token}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    request_with_body(gw.admin, method, path, &headers, body.as_bytes())
}

/// Polls until `f` holds, for at most `limit`: waiting for a condition with
/// a bound, never for a guessed amount of time.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = tollgate::clock::instant() + limit;
    while tollgate::clock::instant() < deadline {
        if f() {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The SHA-256 hex of a raw key, as the policy lists it.
pub fn digest(raw: &str) -> String {
    hex::encode(tollgate::identity::auth::digest(raw.as_bytes()))
}

/// A TLS client configuration (rustls, ring) that trusts the PEM CA
/// certificates in `ca` and offers `alpn` (none when empty).
pub fn tls_client_config(ca: &std::path::Path, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// A private CA and a server certificate for 127.0.0.1 and `localhost` that
/// it signed, made with openssl in `dir`: (CA, certificate chain, key).
pub fn make_certs(dir: &std::path::Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let path = |file: &str| dir.join(format!("{name}-{file}"));
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl must be installed (make test installs it)");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    let s = |p: &PathBuf| p.to_string_lossy().into_owned();
    let (ca_key, ca, key, csr, cert, ext) = (
        path("ca.key"),
        path("ca.pem"),
        path("server.key"),
        path("server.csr"),
        path("server.pem"),
        path("ext.cnf"),
    );
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &s(&ca_key),
        "-out",
        &s(&ca),
        "-days",
        "2",
        "-subj",
        "/CN=tollgate test CA",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &s(&key),
        "-out",
        &s(&csr),
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(&ext, "subjectAltName=IP:127.0.0.1,DNS:localhost\n").expect("write ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        &s(&csr),
        "-CA",
        &s(&ca),
        "-CAkey",
        &s(&ca_key),
        "-CAcreateserial",
        "-out",
        &s(&cert),
        "-days",
        "2",
        "-extfile",
        &s(&ext),
    ]);
    (ca, cert, key)
}
