//! The `idemproxy` command line. `main.rs` only calls [`main`].

mod check;
pub mod explain;
pub mod keys;

use crate::config::Config;
use crate::logging::escape_controls;
use crate::store::{KeyFilter, KeyState};
use clap::{Parser, Subcommand, ValueEnum};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "idemproxy",
    version,
    about = "An idempotent reverse proxy for outbound write APIs"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Configuration file.
    #[arg(
        long,
        global = true,
        env = "IDEMPROXY_CONFIG",
        default_value = "proxy.toml"
    )]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy (applies store migrations on start).
    Serve,
    /// Validate the configuration and print one line per route.
    Check,
    /// Dry run: route, upstream URL, key, fingerprint, entities, version (no network, no store).
    Explain {
        /// HTTP method, e.g. POST.
        method: String,
        /// Path as sent to the main listener, prefix included, e.g. /stripe/v1/charges.
        url_path: String,
        /// A request header, 'Name: value' (repeatable).
        #[arg(short = 'H', long = "header")]
        headers: Vec<String>,
        /// The body: @file, - for stdin, or the text itself.
        #[arg(long)]
        body: Option<String>,
    },
    /// Inspect and release stored keys.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Apply the store migrations and exit.
    Migrate,
    /// The egress listener's certificate authority.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Create the CA the egress listener signs with (idemproxy-ca.pem, and idemproxy-ca.key
    /// readable by its owner only). Never replaces an existing one.
    Init {
        /// Where to write it.
        #[arg(long, default_value = "certs")]
        dir: PathBuf,
    },
    /// The CA of the configuration (egress.ca_cert): its SHA-256 fingerprint, its expiry, and
    /// how to make Node, Python, n8n in Docker and Debian trust it. Never the key.
    Show,
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Show every record of a key (any upstream or credential scope).
    Show { key: String },
    /// The write did not happen: make the key forwardable again (settles an unknown outcome).
    Release {
        key: String,
        /// What you checked and found (kept in the audit trail).
        #[arg(long)]
        note: Option<String>,
        /// Also release a completed key: its stored answer is dropped and the next identical
        /// request is forwarded again — a second write at the upstream. Needs --note.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        which: crate::cli::keys::Which,
    },
    /// The write happened: complete the key with the real answer; retries get it, marked as
    /// set by an operator, and are never forwarded.
    Complete {
        key: String,
        #[command(flatten)]
        asked: crate::cli::keys::Asked,
    },
    /// List recent keys.
    List {
        /// Only keys touching this entity.
        #[arg(long)]
        entity: Option<String>,
        /// Only keys in this state: in_flight, completed, released, unknown.
        #[arg(long)]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
}

/// Runs the command line; the exit code is the command's.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    crate::logging::init(match cli.log_format {
        LogFormat::Text => crate::logging::Format::Text,
        LogFormat::Json => crate::logging::Format::Json,
    });
    // Made before any configuration exists (the configuration names its files).
    if let Command::Ca {
        command: CaCommand::Init { dir },
    } = &cli.command
    {
        return match crate::ca::init(dir) {
            Ok((cert, key)) => {
                println!(
                    "created {} and {} (mode 0600)",
                    cert.display(),
                    key.display()
                );
                println!("next: set [egress] listen in proxy.toml, then `idemproxy ca show` says how to trust it");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if !matches!(cli.command, Command::Serve) {
        // A command whose output is piped into `head` ends quietly when the pipe closes, as
        // other tools do (Rust ignores SIGPIPE, and `println!` would panic on the error). The
        // server keeps ignoring it: a client that hangs up must not stop it.
        // SAFETY: restoring a signal's default disposition touches no memory of ours.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.command {
        Command::Check => check::check(&config),
        Command::Explain {
            method,
            url_path,
            headers,
            body,
        } => explain(&config, &method, &url_path, &headers, body),
        Command::Serve => {
            let mut rt = tokio::runtime::Builder::new_multi_thread();
            // One worker; the other serving threads are connection threads (`threads`).
            // TOKIO_WORKER_THREADS, when set, is the runtime's own override (tokio reads it).
            if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
                rt.worker_threads(1);
            }
            run_on(rt, serve(config))
        }
        Command::Migrate => runtime(migrate(config)),
        Command::Keys { command } => runtime(keys(config, command)),
        Command::Ca { .. } => crate::ca::show(&config.egress.ca_cert).map(|text| print!("{text}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn runtime(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    run_on(tokio::runtime::Builder::new_multi_thread(), fut)
}

fn run_on(
    mut rt: tokio::runtime::Builder,
    fut: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    rt.enable_all().build()?.block_on(fut)
}

fn explain(
    config: &Config,
    method: &str,
    url: &str,
    headers: &[String],
    body: Option<String>,
) -> anyhow::Result<()> {
    let body = match body.as_deref() {
        None => None,
        Some("-") => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            Some(buf.into())
        }
        Some(b) if b.starts_with('@') => {
            let path = Path::new(&b[1..]);
            let bytes = std::fs::read(path).map_err(|e| {
                anyhow::anyhow!("cannot read the body file {}: {e}", path.display())
            })?;
            Some(bytes.into())
        }
        Some(text) => Some(bytes::Bytes::copy_from_slice(text.as_bytes())),
    };
    let report = crate::cli::explain::explain(config, method, url, headers, body)
        .map_err(anyhow::Error::msg)?;
    print!("{}", escape_controls(&report, true));
    Ok(())
}

async fn serve(config: Config) -> anyhow::Result<()> {
    // The handlers go in before the listeners open: a SIGTERM that arrives right after start-up
    // must mean a graceful shutdown, not the default action (die at once).
    let stop = shutdown_signal();
    let server = crate::server::Server::start(config).await?;
    stop.await;
    tracing::info!("shutting down: no new connections; letting in-flight upstream calls finish");
    server.shutdown().await;
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C. The handlers are installed when this is called, not when the
/// future is first polled.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let handlers =
            signal(SignalKind::terminate()).and_then(|t| Ok((t, signal(SignalKind::interrupt())?)));
        async move {
            match handlers {
                Ok((mut term, mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {},
                        _ = int.recv() => {},
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn migrate(config: Config) -> anyhow::Result<()> {
    let opened = crate::store::open(&config.store.url, config.store.lease, false, None).await?;
    opened.store.close().await;
    println!("migrations applied to {}", config.store.display_url());
    Ok(())
}

async fn keys(config: Config, command: KeysCommand) -> anyhow::Result<()> {
    // With the config's keys, answers are shown opened; without them, `<encrypted>`.
    let cipher = config.store.encryption.clone();
    let opened = crate::store::open(&config.store.url, config.store.lease, false, cipher).await?;
    let store = opened.store.clone();
    let result = match command {
        KeysCommand::Show { key } => match crate::admin::key_report(store.as_ref(), &key).await? {
            Some(report) => {
                let text = serde_json::to_string_pretty(&report)?;
                println!("{}", escape_controls(&text, true));
                Ok(())
            }
            None => Err(anyhow::anyhow!("no key {key:?}")),
        },
        KeysCommand::Release {
            key,
            note,
            force,
            which,
        } => {
            let asked = (note.as_deref(), force);
            crate::cli::keys::release(&config, &opened, &key, asked, which).await
        }
        KeysCommand::Complete { key, asked } => {
            crate::cli::keys::complete(&config, &opened, &key, asked).await
        }
        KeysCommand::List {
            entity,
            state,
            limit,
        } => {
            let state = match state.as_deref().map(|s| KeyState::parse(s).ok_or(s)) {
                Some(Err(s)) => {
                    return Err(anyhow::anyhow!(
                        "unknown state {s:?}: use in_flight, completed, released or unknown"
                    ))
                }
                Some(Ok(st)) => Some(st),
                None => None,
            };
            for r in store
                .list_keys(&KeyFilter {
                    entity,
                    state,
                    limit,
                    oldest_first: false,
                })
                .await?
            {
                let status = r
                    .response
                    .as_ref()
                    .map(|x| x.status().to_string())
                    .unwrap_or_else(|| "-".into());
                println!(
                    "{}\t{}\t{}\t{}\tstatus={status}\tattempts={}\tentities={}",
                    escape_controls(&r.id.key, false),
                    r.id.upstream,
                    r.effective_state(crate::store::now_ms()).as_str(),
                    r.route,
                    r.attempts,
                    escape_controls(&r.entities.join(","), false)
                );
            }
            Ok(())
        }
    };
    store.close().await;
    result
}
