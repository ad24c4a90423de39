//! Third-party agent tool wrappers, pinned and unmodified, through a real `idemproxy serve` on
//! the shipped `proxy.toml`, against fakes of HubSpot, Zendesk and Stripe on loopback that count
//! side effects. No model: `tests/agents/drive.py` makes the tool calls a plan lists.
//!
//! * @hubspot/mcp-server 0.4.0 (node, `npm ci` in `tests/agents/node`) and mcp-zendesk 0.0.2
//!   (python): started over MCP stdio, called with `tools/call`;
//! * stripe-agent-toolkit 0.6.1 with stripe 11.0.0 (python, no MCP server): `StripeAPI.run`
//!   in-process.
//!
//! The python side lives in the venv `tests/agents/.venv` (stripe 11.0.0 there, stripe 16.1.0 for
//! `tests/sdk.rs` in the system python): `python3 -m venv tests/agents/.venv &&
//! tests/agents/.venv/bin/python -m pip install -r tests/agents/requirements.txt`. `.ci/run`
//! installs both sides; without them these tests skip with a loud banner, and fail under
//! `CI=true`. `tests/agents/INVENTORY.md` lists every HTTP call the wrappers make.
//!
//! One test per wrapper, each with one proxy and one fake, walks through: the API down (nothing
//! listens), then up; the same call twice; an answer lost after the write, and one lost before
//! it; ten agents making one call at the same moment; ten different updates of one record at
//! the same moment; reads that must never be replayed.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long a driver may take on a loaded two-core machine (ten agents start ten MCP servers),
/// and how long the test waits for its requests to queue up.
const SLOW: Duration = Duration::from_secs(90);

/// The proxy's plain advice in its error messages (`src/error_format.rs`), which the wrappers
/// hand to the model: what matters is that it says whether sending the call again is safe.
const SAFE_TO_RESEND: &str = "Sending the same request again, unchanged, is safe";
const SAFE_LATER: &str = "Sending the same request again later is safe";

fn agents_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/agents")
}

/// The venv `.ci/run` makes for the python wrappers.
fn python() -> PathBuf {
    agents_dir().join(".venv/bin/python")
}

fn python_wrappers() -> bool {
    installed(
        "mcp 1.30.0, mcp-zendesk 0.0.2, stripe-agent-toolkit 0.6.1 and stripe 11.0.0 in tests/agents/.venv",
        Command::new(python()).args([
            "-c",
            "from importlib.metadata import version as v\n\
             got = [v(p) for p in ('mcp', 'mcp-zendesk', 'stripe-agent-toolkit', 'stripe')]\n\
             assert got == ['1.30.0', '0.0.2', '0.6.1', '11.0.0'], got",
        ]),
    )
}

fn node_hubspot() -> bool {
    installed(
        "@hubspot/mcp-server 0.4.0 in tests/agents/node",
        Command::new("node")
            .current_dir(agents_dir().join("node"))
            .args([
                "-e",
                "const v = JSON.parse(require('fs').readFileSync('node_modules/@hubspot/mcp-server/package.json')).version; if (v !== '0.4.0') process.exit(1)",
            ]),
    )
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fixed address in front of a fake API: a socket bound there but not listening, so that
/// connections are refused (and the port stays ours) until [`Gate::open`] listens on it; then
/// every connection is relayed to the fake. The API is "down" until then.
struct Gate {
    addr: SocketAddr,
    socket: tokio::net::TcpSocket,
}

impl Gate {
    fn closed() -> Gate {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind 127.0.0.1:0");
        let addr = socket.local_addr().expect("the gate's address");
        Gate { addr, socket }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn open(self, to: SocketAddr) {
        let listener = self.socket.listen(1024).expect("listen at the gate");
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                        // A fake that drops its connection ends this one too: EOF or reset.
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
    }
}

/// Runs drive.py for one wrapper; each plan is written to a file in the test's dir.
#[derive(Clone)]
struct Agent {
    wrapper: &'static str,
    base: String,
    dir: PathBuf,
}

static PLANS: AtomicUsize = AtomicUsize::new(0);

impl Agent {
    fn new(wrapper: &'static str, base: String, dir: &TestDir) -> Agent {
        Agent {
            wrapper,
            base,
            dir: dir.path().to_owned(),
        }
    }

    /// Makes these calls, in order (see drive.py for the `parallel` and `agents` steps).
    async fn run(&self, steps: Value) -> Vec<Value> {
        let n = PLANS.fetch_add(1, Ordering::Relaxed);
        let plan = self.dir.join(format!("plan-{}-{n}.json", self.wrapper));
        let text = json!({"base": self.base, "steps": steps}).to_string();
        std::fs::write(&plan, text).expect("write the plan");
        drive(self.wrapper, plan).await
    }

    /// The same, in the background (while the test holds and releases requests at the fake).
    fn spawn(&self, steps: Value) -> tokio::task::JoinHandle<Vec<Value>> {
        let agent = self.clone();
        tokio::spawn(async move { agent.run(steps).await })
    }
}

/// Runs `drive.py <wrapper> <plan>` to its end; its stdout is `{"results": [...]}`.
async fn drive(wrapper: &'static str, plan: PathBuf) -> Vec<Value> {
    let child = Command::new(python())
        .arg(agents_dir().join("drive.py"))
        .arg(wrapper)
        .arg(&plan)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run drive.py with {}: {e}", python().display()));
    let pid = child.id();
    let waited = tokio::time::timeout(
        SLOW,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    let out = match waited {
        Ok(joined) => joined
            .expect("the driver's thread")
            .unwrap_or_else(|e| panic!("wait for drive.py: {e}")),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("drive.py {wrapper} {} ran over {SLOW:?}", plan.display());
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "drive.py {wrapper} {} failed\n{stdout}\n{}",
        plan.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    v["results"].as_array().cloned().unwrap_or_default()
}

fn text(r: &Value) -> &str {
    r["text"].as_str().unwrap_or_default()
}

fn failed(r: &Value) -> bool {
    r["isError"] == true
}

/// The results of a `{"parallel": [...]}` or `{"agents": [...]}` step.
fn group(r: &Value) -> Vec<Value> {
    let all = r["parallel"].as_array().or(r["agents"].as_array());
    all.cloned().unwrap_or_default()
}

/// Ten agents, each with its own wrapper, make this call at the same moment.
fn ten_agents(call: Value) -> Value {
    json!([{"agents": vec![call; 10]}])
}

/// A tool's text that is JSON (the HubSpot tools' answers), parsed.
fn json_text(r: &Value) -> Value {
    serde_json::from_str(text(r)).unwrap_or_else(|e| panic!("{e}: not JSON: {r}"))
}

/// Waits until `n` requests are, at the same moment, held at the fake or waiting at the proxy
/// (on a key or an entity lock, its `idemproxy_waiting` gauge): every one of them has been
/// sent, and they are all in the proxy's hands at once. A bounded poll of a condition, as
/// `wait_until`; nothing asserted depends on its timing.
async fn wait_queued(api: &RecordingUpstream, proxy: &ProxyProcess, n: usize) {
    let admin = format!("http://{}", proxy.admin_addr.expect("an admin listener"));
    eventually_within(SLOW, || async {
        let (held, waiting) = (
            api.held(),
            metric(&admin, "idemproxy_waiting").await as usize,
        );
        match held + waiting >= n {
            true => Ok(()),
            false => Err(format!(
                "{held} requests held at the fake and {waiting} waiting at the proxy, not {n}"
            )),
        }
    })
    .await
}

/// Lets ten held writes through one at a time, each once it has arrived: with the proxy
/// serializing them, the next one arrives only after the one before was answered.
async fn release_one_by_one(api: &RecordingUpstream, before: usize) {
    for k in 1..=10 {
        api.wait_for_requests_within(before + k, SLOW).await;
        api.release_one();
    }
}

/// Requests the fake received on `path` whose body contains `marker`.
fn sent(api: &RecordingUpstream, path: &str, marker: &str) -> Vec<Recorded> {
    api.requests()
        .into_iter()
        .filter(|r| r.path() == path && r.body_text().contains(marker))
        .collect()
}

#[path = "agents/fleet.rs"]
mod fleet;
#[path = "agents/hubspot.rs"]
mod hubspot;
#[path = "agents/stripe.rs"]
mod stripe;
#[path = "agents/zendesk.rs"]
mod zendesk;
