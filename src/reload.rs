//! Live policy reload, on SIGHUP or `POST /admin/reload`: the whole file is
//! parsed and validated first, then swapped in atomically. Requests in
//! flight finish under the policy they started with; a broken file is
//! rejected, logged and counted, and the old policy keeps serving.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::config;
use crate::runtime::{Runtime, Services};

/// Why a reload was rejected; the previous policy stays live.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The policy file does not load: unreadable, malformed or invalid.
    #[error(transparent)]
    Policy(#[from] config::ConfigError),
    /// The TLS certificate and key changed since they were validated, and
    /// no longer make a pair that can be served.
    #[error(transparent)]
    Certificate(#[from] crate::tls::CertError),
}

/// Reloads the policy file into the live runtime; shared by SIGHUP and the
/// admin endpoint.
pub struct Reloader {
    path: PathBuf,
    live: Arc<ArcSwap<Runtime>>,
    services: Arc<Services>,
    /// One reload at a time: two racing swaps could go live out of order.
    busy: Mutex<()>,
    /// Called once the replaced runtime is gone: the allocator keeps what a
    /// large policy freed until it is next busy, so an idle gateway would
    /// otherwise hold two policies' memory until its next request.
    released: Option<fn()>,
}

impl Reloader {
    /// A reloader of the policy at `path`, swapping into `live` runtimes built on
    /// `services`.
    pub fn new(path: PathBuf, live: Arc<ArcSwap<Runtime>>, services: Arc<Services>) -> Self {
        Self {
            path,
            live,
            services,
            busy: Mutex::new(()),
            released: None,
        }
    }

    /// Calls `hook` after each reload, once the replaced runtime (its policy
    /// and keys) has been dropped by the last request that held it.
    pub fn on_released(mut self, hook: fn()) -> Self {
        self.released = Some(hook);
        self
    }

    /// The policy file reloaded.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The process-long parts the runtimes are built on.
    pub fn services(&self) -> &Services {
        &self.services
    }

    /// Loads the file again; returns the new policy version, or the error
    /// that kept the old policy in place.
    pub fn reload(&self) -> Result<String, ReloadError> {
        let _one_at_a_time = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let metrics = &self.services.metrics;
        let policy = match config::load(&self.path) {
            Ok(policy) => policy,
            Err(e) => {
                tracing::error!(error = %e, "policy reload rejected; the previous policy stays live");
                metrics.config_reloads.with_label_values(&["error"]).inc();
                return Err(e.into());
            }
        };
        if let (Some(tls), Some(cert)) = (&policy.server.tls, &self.services.certificate) {
            // The files passed validation; they may have changed since.
            if let Err(e) = cert.reload(&tls.cert_file, &tls.key_file) {
                tracing::error!(error = %e, "policy reload rejected; the previous certificate stays");
                metrics.config_reloads.with_label_values(&["error"]).inc();
                return Err(e.into());
            }
        }
        let old = self.live.load_full();
        if policy.store != old.policy.store {
            tracing::warn!("store settings changed; they take effect at the next restart");
        }
        let ledger =
            |p: &config::Policy| p.usage.as_ref().map(|u| (u.spool.clone(), u.sinks.clone()));
        if ledger(&policy) != ledger(&old.policy) {
            // Which routes record takes effect now; the spool and the sinks
            // are opened at start.
            tracing::warn!("usage spool or sinks changed; they take effect at the next restart");
        }
        let (new, was) = (&policy.server, &old.policy.server);
        let listeners = |s: &crate::config::ServerSettings| {
            let tls = s.tls.as_ref().map(|t| t.listen.clone());
            (
                s.listen.clone(),
                s.admin_listen,
                s.threads,
                tls,
                s.access_log.clone(),
                s.edge.http2,
                s.http2_max_streams,
            )
        };
        if listeners(new) != listeners(was) {
            tracing::warn!(
                "listeners, threads, http2, http2_max_streams or the access log changed; they take effect at the next restart"
            );
        }
        let version = policy.policy_version.clone();
        let changes = crate::changes::lines(&old.policy, &policy);
        self.services
            .client_log
            .set_rate(policy.server.log_client_errors_per_s);
        policy.auth.jwt.keep_keys_of(&old.policy.auth.jwt);
        self.live
            .store(Arc::new(Runtime::new(policy, self.services.clone())));
        if let Some(hook) = self.released {
            old.after_drop(hook);
        }
        // Leases were taken under the old numbers.
        self.services.limiter.release_leases();
        metrics.config_reloads.with_label_values(&["ok"]).inc();
        metrics.config_info.reset();
        metrics
            .config_info
            .with_label_values(&[version.as_str()])
            .set(1);
        let changes = if changes.is_empty() {
            "none".to_string()
        } else {
            changes.join("; ")
        };
        tracing::info!(policy_version = %version, %changes, "policy reloaded");
        Ok(version)
    }
}

/// Reloads through `reloader` on each SIGHUP (reopening the access log
/// first, for rotation), from a thread of its own. The handler is in place
/// when this returns, so call it before any listener opens: a SIGHUP sent
/// as soon as the gateway answers (by a deploy script, or a test) is then
/// a reload, never the signal's default action, which ends the process.
/// When no handler can be installed, reloads go through
/// `POST /admin/reload` alone, and the error says so.
pub fn listen_for_hangups(reloader: Arc<Reloader>) -> std::io::Result<()> {
    let (ready, installed) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tollgate hangups".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => return drop(ready.send(Err(e))),
            };
            runtime.block_on(async move {
                use tokio::signal::unix::{signal, SignalKind};
                let mut hangups = match signal(SignalKind::hangup()) {
                    Ok(hangups) => hangups,
                    Err(e) => return drop(ready.send(Err(e))),
                };
                let _ = ready.send(Ok(()));
                while hangups.recv().await.is_some() {
                    if let Some(log) = &reloader.services().access_log {
                        log.reopen();
                    }
                    let reloader = reloader.clone();
                    // Reading and resolving the file may block.
                    let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
                }
            });
        })?;
    installed
        .recv()
        .unwrap_or_else(|_| Err(std::io::Error::other("the SIGHUP thread ended")))
}
