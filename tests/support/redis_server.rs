//! A real `redis-server` on a free loopback port, started and stopped by the
//! test: killed, paused (SIGSTOP), resumed and restarted empty on demand.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::Duration;

pub struct RedisServer {
    pub port: u16,
    /// The TLS port, when the server has one.
    pub tls_port: Option<u16>,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Extra command-line arguments (a replica's `--replicaof`).
    args: Vec<String>,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(Vec::new())
    }

    /// A replica of `primary`, replicating from it as soon as it starts.
    pub fn replica_of(primary: &RedisServer) -> Self {
        Self::start_with(vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.port.to_string(),
        ])
    }

    /// A server that also listens with TLS, its certificate signed by a
    /// private CA; returns it with the CA's PEM file (in the server's
    /// directory). The plain port stays for the test's own commands.
    pub fn start_tls() -> (Self, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let (ca, cert, key) = super::make_certs(dir.path(), "redis");
        let text = |p: std::path::PathBuf| p.to_string_lossy().into_owned();
        let tls_port = super::free_port();
        let mut server = Self::start_in(
            dir,
            vec![
                "--tls-port".into(),
                tls_port.to_string(),
                "--tls-cert-file".into(),
                text(cert),
                "--tls-key-file".into(),
                text(key),
                "--tls-ca-cert-file".into(),
                text(ca.clone()),
                "--tls-auth-clients".into(),
                "no".into(),
            ],
        );
        server.tls_port = Some(tls_port);
        (server, ca)
    }

    /// The TLS url (`rediss://`).
    pub fn tls_url(&self) -> String {
        format!(
            "rediss://127.0.0.1:{}/0",
            self.tls_port.expect("a TLS server")
        )
    }

    fn start_with(args: Vec<String>) -> Self {
        Self::start_in(tempfile::tempdir().expect("tempdir"), args)
    }

    fn start_in(dir: tempfile::TempDir, args: Vec<String>) -> Self {
        // A cluster node also listens on its port + 10 000 (the cluster bus).
        let clustered = args.iter().any(|a| a == "--cluster-enabled");
        let port = move || loop {
            let port = super::free_port();
            if !clustered || port <= 55_535 {
                return port;
            }
        };
        let mut server = RedisServer {
            port: port(),
            tls_port: None,
            child: None,
            dir,
            args,
        };
        // A port found free can be taken by another test before the server
        // binds it; the server then exits, and another port is tried.
        for _ in 0..5 {
            if server.try_spawn() {
                return server;
            }
            server.port = port();
        }
        panic!("redis-server did not start");
    }

    fn spawn(&mut self) {
        assert!(
            self.try_spawn(),
            "redis-server on port {} did not start",
            self.port
        );
    }

    /// Starts the server on `self.port`; false when it exited instead.
    fn try_spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (make test installs it)");
        self.child = Some(child);
        let deadline = tollgate::clock::instant() + Duration::from_secs(10);
        while tollgate::clock::instant() < deadline {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return false;
            }
            if self.cmd::<String>(&["PING"]).is_ok() {
                return true;
            }
            thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not answer", self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A policy's `store` mapping on this server, calls bounded by
    /// `timeout_ms`.
    pub fn store(&self, timeout_ms: u64) -> String {
        format!(
            "{{ backend: redis, urls: [\"{}\"], timeout_ms: {timeout_ms} }}",
            self.url()
        )
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// SIGSTOP: the server keeps its connections but answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Kills the server; its data is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Wait until the port is really closed.
        let deadline = tollgate::clock::instant() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            && tollgate::clock::instant() < deadline
        {
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// A fresh, empty server on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// One command on a fresh connection.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let client = redis::Client::open(self.url())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn)
    }

    /// Every key in the server.
    pub fn keys(&self) -> Vec<String> {
        self.cmd(&["KEYS", "*"]).expect("KEYS")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A paused server must be resumed to die cleanly.
            let _ = Command::new("kill")
                .args(["-CONT", &self.pid().to_string()])
                .status();
        }
        self.kill();
    }
}

/// A Redis Cluster of `n` primaries (no replicas) on free loopback ports,
/// every slot assigned, started and stopped by the test.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(n: usize) -> Self {
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| {
                RedisServer::start_with(vec![
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-config-file".into(),
                    "nodes.conf".into(),
                    "--cluster-node-timeout".into(),
                    "5000".into(),
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli must be installed (it comes with redis-server)");
        assert!(out.status.success(), "redis-cli --cluster create: {out:?}");
        let cluster = RedisCluster { nodes };
        let deadline = tollgate::clock::instant() + Duration::from_secs(20);
        while !cluster.nodes.iter().all(|n| {
            n.cmd::<String>(&["CLUSTER", "INFO"])
                .is_ok_and(|info| info.contains("cluster_state:ok"))
        }) {
            assert!(
                tollgate::clock::instant() < deadline,
                "the cluster never became ok"
            );
            thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// A policy's `store` mapping on this cluster, calls bounded by
    /// `timeout_ms`.
    pub fn store(&self, timeout_ms: u64) -> String {
        let urls: Vec<String> = self.urls().iter().map(|u| format!("\"{u}\"")).collect();
        format!(
            "{{ backend: redis_cluster, urls: [{}], timeout_ms: {timeout_ms} }}",
            urls.join(", ")
        )
    }

    /// The seed urls, one per node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// Every key on every node.
    pub fn keys(&self) -> Vec<String> {
        self.nodes.iter().flat_map(|n| n.keys()).collect()
    }

    /// `GET` of a key, from the node that holds it.
    /// A string key's value (binary, as the script writes state), from
    /// whichever node holds it.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.nodes
            .iter()
            .find_map(|n| n.cmd::<Option<Vec<u8>>>(&["GET", key]).ok().flatten())
    }
}

/// A Redis Sentinel watching one primary as `mymaster` (quorum 1, down
/// after 500 ms), on a free loopback port; stopped on drop.
pub struct RedisSentinel {
    pub port: u16,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl RedisSentinel {
    /// The name the sentinel knows the primary by.
    pub const MASTER: &'static str = "mymaster";

    pub fn watching(primary: &RedisServer) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        for _ in 0..5 {
            let port = super::free_port();
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n\
                     sentinel monitor {m} 127.0.0.1 {} 1\n\
                     sentinel down-after-milliseconds {m} 500\n\
                     sentinel failover-timeout {m} 5000\n\
                     sentinel parallel-syncs {m} 1\n",
                    dir.path().display(),
                    primary.port,
                    m = Self::MASTER,
                ),
            )
            .expect("write sentinel.conf");
            // The sentinel is redis-server in sentinel mode: no other package.
            let mut child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed (make test installs it)");
            let deadline = tollgate::clock::instant() + Duration::from_secs(10);
            let mut up = false;
            while tollgate::clock::instant() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if Self::ask::<String>(port, &["PING"]).is_ok() {
                    up = true;
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
            if up {
                return RedisSentinel {
                    port,
                    child: Some(child),
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server --sentinel did not start");
    }

    fn ask<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn)
    }

    /// One command to the sentinel.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        Self::ask(self.port, args)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port of the primary the sentinel names now.
    pub fn primary_port(&self) -> Option<u16> {
        let addr: Vec<String> = self
            .cmd(&["SENTINEL", "get-master-addr-by-name", Self::MASTER])
            .ok()?;
        addr.get(1)?.parse().ok()
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
