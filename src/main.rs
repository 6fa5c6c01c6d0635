//! The `tollgate` command: `run`, `check` and `hash-key`.
#![deny(unsafe_code)]

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use arc_swap::ArcSwap;
use clap::{Parser, Subcommand};
use pingora::listeners::ListenerConfig;
use pingora::protocols::l4::stream::L4BufferSettings;
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use pingora::services::background::background_service;
use pingora::services::listening::Service;

use pingora::apps::HttpServerOptions;
use pingora::listeners::tls::TlsSettings;
use pingora::protocols::http::v2::server::default_h2_options;
use tollgate::access_log::AccessLog;
use tollgate::admin::{Admin, EnvToken};
use tollgate::config::{self, Backend, StoreSettings};
use tollgate::drain::{AdminListener, Drain, Drainer};
use tollgate::edge::app::Edge;
use tollgate::edge::listener::{Listener, Open};
use tollgate::health::HealthChecker;
use tollgate::limits::breaker::Breaker;
use tollgate::limits::keys::KeyHasher;
use tollgate::limits::limiter::{Limiter, Shared};
use tollgate::limits::memory::MemoryStore;
use tollgate::limits::redis::cluster::ClusterStore;
use tollgate::limits::redis::{Bounds, RedisStore};
use tollgate::limits::SharedStore;
use tollgate::logs::ClientLog;
use tollgate::metrics::Metrics;
use tollgate::pools::Pools;
use tollgate::proxy::Gateway;
use tollgate::reload::{listen_for_hangups, Reloader};
use tollgate::runtime::{Keeper, Kept, Runtime, Services};
use tollgate::tls::Certificate;
use tollgate::top::{Redactor, Top};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Hands the pages freed so far back to the system. mimalloc returns freed
/// pages lazily, on later allocations; after a reload of a large keys file
/// an idle gateway would keep the old table's pages resident until it next
/// served traffic.
#[allow(unsafe_code)]
fn return_freed_memory() {
    // SAFETY: mi_collect has no preconditions; it may be called from any
    // thread at any time, and only frees memory no allocation refers to.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A rate-limiting gateway for multi-tenant HTTP APIs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve with the given policy.
    Run {
        #[arg(long, short)]
        config: PathBuf,
        /// Log lines as JSON instead of text.
        #[arg(long)]
        log_json: bool,
    },
    /// Validate a policy file, print a summary, exit 0 (valid) or 1.
    Check {
        #[arg(long, short)]
        config: PathBuf,
        /// Also list what changes against this (older) policy: limits and
        /// routes added, removed and changed, and which budgets go down.
        #[arg(long)]
        against: Option<PathBuf>,
    },
    /// Read a raw API key on stdin, print its SHA-256 in hex.
    HashKey,
    /// Show what the policy does with a request: its route, and per limit
    /// the numbers after plan overrides, the store key and what a request
    /// needs of it. The static half of `GET /admin/explain`.
    Explain(ExplainArgs),
    /// Print the JSON Schema (draft 2020-12) of a policy file, for editors.
    Schema {
        /// The schema of a keys file (`auth.keys_file`) instead.
        #[arg(long)]
        keys_file: bool,
    },
    /// Replay an access log against a policy (or two) in virtual time and
    /// report what would have been admitted, refused and flagged.
    Simulate(SimulateArgs),
    /// Read the usage ledger's Redis stream (the policy's `usage` sink).
    #[command(subcommand)]
    Usage(UsageCommand),
}

#[derive(Subcommand)]
enum UsageCommand {
    /// Print the last records, oldest first, one JSON object per line (as
    /// `simulate --log` reads them).
    Tail {
        #[arg(long, short)]
        config: PathBuf,
        /// How many, at most.
        #[arg(long, short = 'n', default_value_t = 10)]
        count: usize,
        /// Only records of this recent span, e.g. `1h`, `30m`.
        #[arg(long)]
        since: Option<String>,
        /// Only these fields of each record, comma-separated (the fields
        /// `summary --by` takes).
        #[arg(long, value_delimiter = ',')]
        by: Vec<String>,
    },
    /// Sum the records of a recent span by the fields named.
    Summary {
        #[arg(long, short)]
        config: PathBuf,
        /// How far back, e.g. `1h`, `30m`, `7days`.
        #[arg(long, default_value = "1h")]
        since: String,
        /// Fields to group by, comma-separated: tenant, credential, plan,
        /// route, method, status, cost_source, instance, or values.LIMIT
        /// (the `values` entry a limit's key matched, e.g. the model).
        #[arg(long, default_value = "tenant,route", value_delimiter = ',')]
        by: Vec<String>,
    },
}

#[derive(clap::Args)]
struct ExplainArgs {
    #[arg(long, short)]
    config: PathBuf,
    /// The request path, as a client sends it.
    #[arg(long)]
    path: String,
    #[arg(long, default_value = "GET")]
    method: String,
    /// The request's Host header.
    #[arg(long)]
    host: Option<String>,
    /// A credential id of the policy's keys.
    #[arg(long, conflicts_with = "key")]
    credential: Option<String>,
    /// `-`: read the caller's raw API key from stdin (a key on the command
    /// line would stay in shell history and `ps`).
    #[arg(long)]
    key: Option<String>,
    /// A tenant, for limits keyed by tenant without a credential.
    #[arg(long)]
    tenant: Option<String>,
    /// The client address, for limits keyed by ip.
    #[arg(long)]
    ip: Option<std::net::IpAddr>,
    /// The cost to explain for; the route's when absent.
    #[arg(long)]
    cost: Option<u64>,
    /// A value of a dimension read from requests, as `header.x-end-user=alice`
    /// (repeatable).
    #[arg(long = "value", value_name = "DIMENSION=VALUE")]
    values: Vec<String>,
}

#[derive(clap::Args)]
struct SimulateArgs {
    /// The policy to try; a second --config compares the two.
    #[arg(long, short, required = true, num_args = 1)]
    config: Vec<PathBuf>,
    /// The access log; `-` for standard input.
    #[arg(long)]
    log: PathBuf,
    /// The log's format: tollgate (JSON lines) or combined (NGINX).
    #[arg(long, default_value = "tollgate")]
    log_format: tollgate::simulate::LogFormat,
    /// The field naming the caller's credential id: a JSON member
    /// (default `credential`), or a `name=value` field after the combined
    /// ones (default `$remote_user`).
    #[arg(long)]
    key_field: Option<String>,
    /// Replay only lines at or after this RFC 3339 time.
    #[arg(long)]
    from: Option<String>,
    /// Replay only lines before this RFC 3339 time.
    #[arg(long)]
    to: Option<String>,
    /// Callers listed in the report.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Also write a self-contained HTML report (charts and tables) here.
    #[arg(long)]
    report: Option<PathBuf>,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Check { config, against } => match config::load(&config) {
            Ok(policy) => {
                for warning in policy.warnings() {
                    eprintln!("{}: warning: {warning}", config.display());
                }
                println!("{}: {}", config.display(), policy.summary());
                if let Some(old) = against {
                    // The exit code is the new policy's: an old one that
                    // no longer loads is said, not failed on.
                    match config::load(&old) {
                        Ok(old_policy) => {
                            let changes = tollgate::changes::lines(&old_policy, &policy);
                            let none = if changes.is_empty() { " none" } else { "" };
                            println!("changes against {}:{none}", old.display());
                            for line in changes {
                                println!("  {line}");
                            }
                        }
                        Err(e) => eprintln!("--against: cannot compare: {e}"),
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        },
        Command::Simulate(args) => printed(simulate(&args)),
        Command::Usage(command) => printed(usage(&command)),
        Command::Schema { keys_file } => {
            let schema = if keys_file {
                config::schema::keys_file_schema()
            } else {
                config::schema::policy_schema()
            };
            printed(
                serde_json::to_string_pretty(&schema)
                    .map(|text| text + "\n")
                    .map_err(Into::into),
            )
        }
        Command::Explain(args) => printed(explain(&args)),
        Command::HashKey => printed(hash_key().map(|hex| hex + "\n")),
        Command::Run { config, log_json } => {
            let client_log = init_logs(log_json);
            if let Err(e) = run(config, client_log) {
                eprintln!("tollgate: {e:#}");
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
    }
}

/// Prints a command's text, or its error; the exit code says which.
fn printed(result: anyhow::Result<String>) -> ExitCode {
    match result {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--by`'s fields, each one a record can be grouped by.
fn fields_known(by: &[String]) -> anyhow::Result<()> {
    use tollgate::usage::report;
    match by.iter().find(|f| !report::groups_by(f)) {
        Some(unknown) => anyhow::bail!(
            "--by {unknown:?}: one of {}, or values.LIMIT",
            report::GROUPS.join(", ")
        ),
        None => Ok(()),
    }
}

/// The start of `--since`'s span, in Unix milliseconds.
fn since_ms(since: &str) -> anyhow::Result<u64> {
    let span =
        humantime::parse_duration(since).map_err(|e| anyhow::anyhow!("--since {since:?}: {e}"))?;
    let now = tollgate::clock::wall_ms();
    Ok(now.saturating_sub(span.as_millis() as u64))
}

/// `tollgate usage`: the ledger's Redis stream, read with a connection of
/// its own.
fn usage(command: &UsageCommand) -> anyhow::Result<String> {
    use tollgate::usage::report;
    let config = match command {
        UsageCommand::Tail { config, .. } | UsageCommand::Summary { config, .. } => config,
    };
    let policy = config::load(config)?;
    let Some((key, urls, cluster)) = policy.usage.as_ref().and_then(|u| {
        u.sinks.iter().find_map(|s| match s {
            config::SinkSettings::RedisStream { key, urls, cluster } => {
                Some((key.clone(), urls.clone(), *cluster))
            }
            config::SinkSettings::Http { .. } => None,
        })
    }) else {
        anyhow::bail!(
            "{}: usage has no redis_stream sink to read",
            config.display()
        );
    };
    let timeout = std::time::Duration::from_secs(5);
    let mut conn: Box<dyn redis::ConnectionLike> = if cluster {
        let client = redis::cluster::ClusterClient::builder(urls)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .build()?;
        Box::new(client.get_connection()?)
    } else {
        let client = redis::Client::open(urls[0].as_str())?;
        let conn = client.get_connection_with_timeout(timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        Box::new(conn)
    };
    type Entries = Vec<(String, Vec<(String, String)>)>;
    match command {
        UsageCommand::Tail {
            count, since, by, ..
        } => {
            fields_known(by)?;
            let first = match since {
                Some(since) => format!("{}-0", since_ms(since)?),
                None => "-".to_owned(),
            };
            let mut entries: Entries = redis::cmd("XREVRANGE")
                .arg(&key)
                .arg("+")
                .arg(first)
                .arg("COUNT")
                .arg(*count)
                .query(conn.as_mut())?;
            entries.reverse();
            if by.is_empty() {
                return Ok(entries
                    .iter()
                    .filter_map(|(_, fields)| fields.iter().find(|(n, _)| n == "record"))
                    .map(|(_, json)| format!("{json}\n"))
                    .collect());
            }
            Ok(report::records_of(&entries)
                .iter()
                .map(|record| format!("{}\n", report::fields_of(record, by)))
                .collect())
        }
        UsageCommand::Summary { since, by, .. } => {
            fields_known(by)?;
            let from = since_ms(since)?;
            let mut start = format!("{from}-0");
            let mut records = Vec::new();
            loop {
                let page: Entries = redis::cmd("XRANGE")
                    .arg(&key)
                    .arg(&start)
                    .arg("+")
                    .arg("COUNT")
                    .arg(1000)
                    .query(conn.as_mut())?;
                records.extend(report::records_of(&page));
                match page.last() {
                    Some((id, _)) if page.len() == 1000 => start = format!("({id}"),
                    _ => break,
                }
            }
            let sums = report::summarize(&records, by);
            Ok(format!(
                "{} records since {}\n\n{}",
                records.len(),
                humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(from)
                ),
                report::table(&sums, by)
            ))
        }
    }
}

/// `tollgate simulate`: the report of each policy, and their difference.
fn simulate(args: &SimulateArgs) -> anyhow::Result<String> {
    use tollgate::simulate::{difference, html, report, run, LogReader, Simulation};
    let SimulateArgs {
        config: configs,
        log,
        top,
        ..
    } = args;
    anyhow::ensure!(
        configs.len() <= 2,
        "at most two policies (--config old --config new)"
    );
    let time = |t: &Option<String>, what: &str| -> anyhow::Result<_> {
        t.as_deref()
            .map(|t| humantime::parse_rfc3339(t).with_context(|| format!("--{what} {t:?}")))
            .transpose()
    };
    let (from, to) = (time(&args.from, "from")?, time(&args.to, "to")?);
    let mut sims = configs
        .iter()
        .map(|c| {
            config::load(c)
                .map(Simulation::new)
                .map_err(|e| anyhow::anyhow!("{e}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let input: Box<dyn std::io::BufRead> = if log.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(log).with_context(|| format!("--log {}", log.display()))?;
        Box::new(std::io::BufReader::with_capacity(1 << 20, file))
    };
    let reader = LogReader {
        format: args.log_format,
        key_field: args.key_field.clone(),
    };
    run(input, &reader, &mut sims, from, to).context("reading the log")?;
    let names: Vec<String> = configs.iter().map(|c| c.display().to_string()).collect();
    let mut out = String::new();
    for (name, sim) in names.iter().zip(&sims) {
        out += &report(name, sim, *top);
        out.push('\n');
    }
    if let [old, new] = &sims[..] {
        out += &difference(old, new, *top);
    }
    if let Some(path) = &args.report {
        std::fs::write(path, html::page(&names, &sims, *top))
            .with_context(|| format!("--report {}", path.display()))?;
        out += &format!("\nreport written to {}\n", path.display());
    }
    Ok(out)
}

/// A raw API key read from stdin, without the newline `echo` adds.
fn key_from_stdin() -> anyhow::Result<Vec<u8>> {
    let mut raw = Vec::new();
    std::io::stdin()
        .read_to_end(&mut raw)
        .context("reading stdin")?;
    if raw.ends_with(b"\n") {
        raw.pop();
        if raw.ends_with(b"\r") {
            raw.pop();
        }
    }
    anyhow::ensure!(!raw.is_empty(), "no key on stdin");
    Ok(raw)
}

fn hash_key() -> anyhow::Result<String> {
    Ok(hex::encode(tollgate::identity::auth::digest(
        &key_from_stdin()?,
    )))
}

/// `tollgate explain`: the request resolved as `/admin/explain` resolves
/// it, shown with the store keys the gateway would use.
fn explain(args: &ExplainArgs) -> anyhow::Result<String> {
    use tollgate::explain::{resolve, to_text, Query, StoreKeys};
    let policy = config::load(&args.config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (credential, verified) = match args.key.as_deref() {
        Some("-") => {
            let key = key_from_stdin()?;
            let jwt = &policy.auth.jwt;
            if !jwt.is_empty() && tollgate::identity::jwt::looks_like_jwt(&key) {
                let caller = jwt
                    .verify(
                        &key,
                        |name| policy.plan_id(name),
                        tollgate::clock::wall_ms() / 1000,
                    )
                    .map_err(|f| anyhow::anyhow!("the JWT on stdin is refused ({})", f.reason()))?;
                (None, Some(Arc::new(caller)))
            } else {
                let found = policy
                    .auth
                    .keys
                    .verify(&key)
                    .context("the key on stdin is none of the policy's keys")?;
                (Some(found.id.to_string()), None)
            }
        }
        Some(_) => anyhow::bail!("--key takes `-` and reads the key from stdin"),
        None => (args.credential.clone(), None),
    };
    let q = Query {
        path: args.path.clone(),
        method: args.method.to_ascii_uppercase(),
        host: args.host.clone(),
        credential,
        tenant: args.tenant.clone(),
        ip: args.ip,
        plan: None,
        cost: args.cost,
        verified,
        values: args
            .values
            .iter()
            .map(|v| {
                v.split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .ok_or_else(|| anyhow::anyhow!("--value takes DIMENSION=VALUE, got {v:?}"))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    anyhow::ensure!(q.path.starts_with('/'), "--path must start with \"/\"");
    let explained = resolve(&policy, &q, |_| None).map_err(|p| anyhow::anyhow!("{}", p.detail))?;
    let store = &policy.store;
    let secret = std::env::var(&store.key_secret_env)
        .ok()
        .filter(|s| !s.is_empty());
    let hasher = secret
        .as_ref()
        .map(|s| tollgate::limits::keys::KeyHasher::new(&store.key_prefix, s.as_bytes()));
    let keys = match (&hasher, store.backend) {
        (_, Backend::Memory) => StoreKeys::InProcess,
        (Some(h), _) => StoreKeys::Hashed(h),
        (None, _) => StoreKeys::Unknown(format!("{} is not set", store.key_secret_env)),
    };
    Ok(to_text(&policy, &q, &explained, &keys))
}

/// Installs the log subscriber; the limiter of client-caused lines, whose
/// rate the policy sets.
fn init_logs(json: bool) -> Arc<ClientLog> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Bad requests are the clients' doing: their lines are limited.
    let client_log = ClientLog::new(1);
    let filter = client_log.install();
    if json {
        builder.json().finish().with(filter).init();
    } else {
        builder.finish().with(filter).init();
    }
    client_log
}

/// `tollgate run`: the policy loaded, the process-long parts made, then the
/// listeners and background services wired into one Pingora server.
fn run(path: PathBuf, client_log: Arc<ClientLog>) -> anyhow::Result<()> {
    // What the files held before they were read, for the watch.
    let baseline = tollgate::watch::baseline(&path);
    let policy = config::load(&path).map_err(|e| anyhow::anyhow!("{e}"))?;
    client_log.set_rate(policy.server.log_client_errors_per_s);
    tracing::info!("{}", policy.summary());
    if config::is_demo(&path) {
        tracing::warn!(
            config = %path.display(),
            "serving the demo policy of the container image; mount your own policy at this path"
        );
    }
    for warning in policy.warnings() {
        tracing::warn!("{warning}");
    }
    let settings = policy.server.clone();
    let conf = ServerConf {
        threads: settings.threads,
        // After SIGTERM the listeners close at once; the drainer exits as
        // soon as the requests in flight finished, within the grace period.
        // Pingora's own wait is a second longer, a backstop.
        grace_period_seconds: Some(settings.shutdown_grace.as_secs() + 1),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let services = services(&policy, client_log)?;
    let live = Arc::new(ArcSwap::from_pointee(Runtime::new(
        policy,
        services.clone(),
    )));
    let reloader = Arc::new(
        Reloader::new(path, live.clone(), services.clone()).on_released(return_freed_memory),
    );
    // Before any listener: a SIGHUP is a reload from the moment the
    // gateway can be reached.
    if let Err(e) = listen_for_hangups(reloader.clone()) {
        tracing::error!(error = %e, "cannot listen for SIGHUP; reload with POST /admin/reload");
    }
    if settings.watch {
        if let Err(e) = tollgate::watch::spawn(reloader.clone(), baseline) {
            tracing::error!(error = %e, "cannot watch the policy's files; reload with SIGHUP");
        }
    }
    let drain = Drain::new();
    add_proxy_listeners(&mut server, &settings, &live, &services, &drain)?;
    server.add_service(background_service(
        "health checks",
        HealthChecker::new(live.clone()),
    ));
    if let Some(addr) = settings.admin_listen {
        add_admin_listener(&mut server, addr, live.clone(), reloader, &services, &drain)?;
    }
    server.add_service(background_service(
        "admin records",
        tollgate::runtime::RecordsRefresher::new(live.clone()),
    ));
    server.add_service(background_service(
        "lease keeper",
        Keeper::new(services.limiter.clone(), Kept::Leases),
    ));
    server.add_service(background_service(
        "hold keeper",
        Keeper::new(services.limiter.clone(), Kept::Holds),
    ));
    server.add_service(background_service(
        "drain on SIGTERM",
        Drainer::new(drain, settings.shutdown_grace, move |left| {
            let services = services.clone();
            Box::pin(async move {
                services.limiter.return_leases().await;
                services.limiter.release_holds().await;
                if let Some(log) = &services.access_log {
                    log.flush(std::time::Duration::from_secs(1)).await;
                }
                if let Some(ledger) = &services.usage {
                    // The spool is on disk at once; its sinks are waited
                    // for within the drain time, what is left shipped after
                    // the next start.
                    ledger.flush(left.min(tollgate::usage::FLUSH_LIMIT)).await;
                }
            })
        }),
    ));
    server.run_forever()
}

/// The parts that live as long as the process: metrics, the limiter and
/// its store, the access log, the certificate, pools, heavy hitters.
fn services(policy: &config::Policy, client_log: Arc<ClientLog>) -> anyhow::Result<Arc<Services>> {
    let settings = &policy.server;
    let metrics = Arc::new(Metrics::new());
    client_log.attach(metrics.log_suppressed.clone());
    metrics
        .build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    metrics
        .config_info
        .with_label_values(&[policy.policy_version.as_str()])
        .set(1);
    let shared = shared_store(&policy.store)?;
    let access_log = match &settings.access_log {
        Some(log) => Some(
            AccessLog::open(log, metrics.access_log_dropped.clone())
                .with_context(|| format!("server.access_log: cannot open {:?}", log.destination))?,
        ),
        None => None,
    };
    let usage = match &policy.usage {
        Some(usage) => Some(
            tollgate::usage::Ledger::start(
                usage,
                metrics.clone(),
                tollgate::usage::instance_name(),
            )
            .with_context(|| format!("usage.spool: cannot open {:?}", usage.spool.path))?,
        ),
        None => None,
    };
    let certificate = match &settings.tls {
        Some(tls) => Some(Arc::new(
            Certificate::load(&tls.cert_file, &tls.key_file)
                .map_err(|e| anyhow::anyhow!("server.tls: {e}"))?,
        )),
        None => None,
    };
    let tracer = match &settings.tracing {
        Some(to) => Some(
            tollgate::trace::otlp::install(to, metrics.trace_spans_dropped.clone())
                .context("server.tracing: cannot start the span exporter")?,
        ),
        None => None,
    };
    Ok(Arc::new(Services {
        body_budget: tollgate::edge::body::BodyBudget::new(),
        client_log,
        access_log,
        certificate,
        limiter: Arc::new(Limiter::new(
            Arc::new(MemoryStore::default()),
            shared,
            metrics.clone(),
        )),
        pools: Pools::new(metrics.clone()),
        metrics,
        top: Top::new(),
        redactor: Redactor::new()
            .context("reading /dev/urandom for the key of hashed identities")?,
        revocations: Arc::default(),
        overrides: Arc::default(),
        store_keys: Arc::default(),
        tracer,
        usage,
        wall: Arc::new(tollgate::clock::SystemWall),
    }))
}

/// One proxy for every listener; each plain and TLS listener has its own
/// edge, which counts and bounds its connections.
fn add_proxy_listeners(
    server: &mut Server,
    settings: &config::ServerSettings,
    live: &Arc<ArcSwap<Runtime>>,
    services: &Services,
    drain: &Arc<Drain>,
) -> anyhow::Result<()> {
    let mut proxy = pingora::proxy::http_proxy(
        &server.configuration,
        Gateway::new(live.clone(), drain.clone()),
    );
    if settings.edge.http2 {
        // Reached only for connections the edge saw speak HTTP/2.
        let mut options = HttpServerOptions::default();
        options.h2c = true;
        options.h2_idle_timeout = Some(settings.edge.keepalive_idle);
        proxy.server_options = Some(options);
        // Pingora's bounded defaults, with the policy's bounds: the header
        // list, and the streams a client may have open on a connection,
        // announced in SETTINGS.
        let mut h2 = default_h2_options();
        h2.max_header_list_size(settings.edge.max_header_bytes as u32);
        h2.max_concurrent_streams(settings.http2_max_streams);
        proxy.h2_options = Some(h2);
        tollgate::edge::app::answer_malformed_authorities();
    }
    let proxy = Arc::new(proxy);
    let edge_settings: tollgate::edge::LiveSettings = {
        let live = live.clone();
        Arc::new(move || live.load().policy.server.edge)
    };
    // One bound for every proxy listener: `max_connections` is the
    // instance's.
    let open = Arc::new(Open::default());
    let edge = |name: &str| {
        let listener = Listener::sharing(name, &services.metrics, open.clone());
        Edge::new(proxy.clone(), edge_settings.clone(), listener)
    };
    for addr in &settings.listen {
        let name = addr.to_string();
        let mut service = Service::new(format!("tollgate proxy {name}"), edge(&name));
        // No read buffer under the edge: it reads each head into its own
        // bounded buffer, so a second 64 KiB one per connection would only
        // hold memory for clients that stall.
        service.add_listener(
            ListenerConfig::tcp(&name).l4_buffer(L4BufferSettings::default().read(0)),
        );
        server.add_service(service);
    }
    let (Some(tls), Some(certificate)) = (&settings.tls, &services.certificate) else {
        return Ok(());
    };
    for addr in &tls.listen {
        let name = addr.to_string();
        let paths = (
            tls.cert_file.to_string_lossy(),
            tls.key_file.to_string_lossy(),
        );
        let mut tls_settings = TlsSettings::intermediate(&paths.0, &paths.1)
            .map_err(|e| anyhow::anyhow!("server.tls: {e}"))?;
        // The certificate comes from here, so that a reload can swap it.
        tls_settings.set_cert_resolver(certificate.clone());
        if settings.edge.http2 {
            tls_settings.enable_h2();
        }
        // The edge does the handshake, after the connection took its slot
        // and within `header_read_ms`; the listener is plain TCP.
        let edge = edge(&name).with_tls(tls_settings.build());
        let mut service = Service::new(format!("tollgate TLS proxy {name}"), edge);
        service.add_listener(ListenerConfig::tcp(&name));
        server.add_service(service);
    }
    Ok(())
}

/// The admin listener, served outside Pingora's services so that it keeps
/// answering through a drain; its connections are guarded like the
/// proxy's, within bounds of their own (in all, per client address, and a
/// second of idling), so a flood cannot lock out `/readyz`.
fn add_admin_listener(
    server: &mut Server,
    addr: std::net::SocketAddr,
    live: Arc<ArcSwap<Runtime>>,
    reloader: Arc<Reloader>,
    services: &Services,
    drain: &Arc<Drain>,
) -> anyhow::Result<()> {
    let settings = &live.load().policy.server;
    let access = EnvToken::from_env(settings.admin_token_env.as_deref());
    if access == EnvToken::Missing {
        tracing::warn!("server.admin_token_env names an unset variable: /admin/* is closed");
    }
    let admin_settings: tollgate::edge::LiveSettings = {
        let live = live.clone();
        Arc::new(move || {
            let server = &live.load().policy.server;
            tollgate::edge::EdgeSettings {
                max_connections: server.admin_max_connections,
                max_connections_per_ip: server.admin_max_connections_per_ip,
                // An admin client asks at once: a connection that sends no
                // request for a second gives its slot back.
                header_read: server.edge.header_read.min(tollgate::admin::IDLE),
                keepalive_idle: tollgate::admin::IDLE,
                http2: false,
                ..server.edge
            }
        })
    };
    let admin = Admin::new(live, reloader, access, drain.clone());
    let listener = Listener::new("admin", &services.metrics);
    let admin = Edge::new(Arc::new(admin), admin_settings, listener);
    let listener = AdminListener::bind(addr, admin)
        .with_context(|| format!("server.admin_listen: cannot listen on {addr}"))?;
    server.add_service(background_service("tollgate admin", listener));
    Ok(())
}

/// The shared store the policy asks for, with its guards.
fn shared_store(settings: &StoreSettings) -> anyhow::Result<Option<Shared>> {
    if settings.backend == Backend::Memory {
        return Ok(None);
    }
    let secret = std::env::var(&settings.key_secret_env)
        .ok()
        .filter(|s| !s.is_empty())
        .with_context(|| {
            format!(
                "store.key_secret_env: environment variable {} is not set; \
                 the {} backend needs it to hash identities in store keys",
                settings.key_secret_env, settings.backend
            )
        })?;
    let keys = KeyHasher::new(&settings.key_prefix, secret.as_bytes());
    let bounds = Bounds {
        timeout: settings.timeout,
        max_pending: settings.max_pending,
    };
    let store: Arc<dyn SharedStore> = match settings.backend {
        Backend::Memory => return Ok(None),
        Backend::Redis => Arc::new(
            RedisStore::new(&settings.urls[0], keys, bounds)
                .map_err(|e| anyhow::anyhow!("store.urls[0]: {e}"))?,
        ),
        Backend::RedisCluster => Arc::new(
            ClusterStore::new(&settings.urls, keys, bounds)
                .map_err(|e| anyhow::anyhow!("store.urls: {e}"))?,
        ),
        Backend::RedisSentinel => Arc::new(
            RedisStore::sentinel(
                &settings.urls,
                settings.master_name.as_deref().unwrap_or_default(),
                keys,
                bounds,
            )
            .map_err(|e| anyhow::anyhow!("store.urls: {e}"))?,
        ),
    };
    Ok(Some(Shared {
        store,
        breaker: Breaker::new(settings.failure_threshold, settings.open_for),
        timeout: settings.timeout,
        instances: settings.expected_instances,
    }))
}
