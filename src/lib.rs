//! # idemproxy
//!
//! An idempotent reverse proxy for outbound write APIs. Three wings at the top, each a folder
//! with its own map, over the floors they share:
//!
//! - [`cli`]: the `idemproxy` commands (`serve`, `check`, `explain`, `keys`, `migrate`, `ca`);
//!   `cli::explain` is the dry run, `cli::keys` settles a key from the command line.
//! - [`server`]: the serving wing — listeners (main, per-upstream, admin, egress), the accept
//!   loop and shedding, the router, the egress listener, graceful shutdown.
//! - [`rules`]: the little languages of routes (templates, body paths, path patterns, a
//!   reconciled answer's shape) and request data read exactly (form and query bytes, JSON
//!   numbers by value).
//!
//! What they share, in the order a request meets it. `threads`, `state` and `reload` belong to
//! serving but sit below the wings: the upstream clients and the store's engine use `threads`,
//! the pipeline, the admin API and the console use `state`, the admin API uses `reload`; inside
//! `server/` each would make an import circle with a wing that `server` itself calls.
//!
//! - [`connection`]: one accepted connection served, HTTP/1.1 or HTTP/2, parked when idle with
//!   hyper's buffers freed (an idle connection costs a few KiB); the request body type that
//!   tells whether a body was read to its end; tunnels spliced without buffers.
//! - [`threads`]: connection threads beside the runtime's one worker, each keeping its
//!   connections, their tasks and its upstream pools on one thread.
//! - [`state`]: the state every request shares (`AppState`), and the one in force (`Live`).
//! - [`reload`]: the configuration read again on `SIGHUP` or `POST /admin/reload`.
//! - [`pipeline`]: the protected-request pipeline, SPEC.md's seven steps in seven files —
//!   prepare, lookup, lock, checks, reserve, forward, store — over one request context and one
//!   typed outcome; beside them, observe mode, the reads sent on a request's behalf (precheck,
//!   reconcile), the reconcile of unknown outcomes, and each request's turn in its account's
//!   rate-limit budget (`pipeline::pace`).
//! - [`pace`]: each API's rate limit kept per account: a budget per credential scope (a send
//!   log and a bucket, a fair queue of callers), learned from the API's headers, paused by its
//!   `429`s, shared by replicas through the store on PostgreSQL.
//! - [`upstream`]: the upstream side: pooled clients (rustls, per-upstream trust roots), header
//!   hygiene, the call of a protected request and its outcome table, passthrough streaming.
//! - [`config`]: `proxy.toml`, parsed and validated into compiled types at load.
//! - [`key`]: client keys, derived keys, fingerprints, credential scopes.
//! - [`scope_secret`]: which secret keys a store's scopes (`scope_secret`, one derived from an
//!   encryption key, or SQLite's generated `.secret` file).
//! - [`locks`]: in-process one-holder/many-waiters locks for keys and entities.
//! - [`store`]: the durable store, asked through narrow traits by who asks
//!   (`store::api`: `Keys` — get, reserve, finish, renew, a `Ticket` from reserve to finish;
//!   `EntityStates`; `Operator`; `AuditLog`; `Shared`, the cross-process part only
//!   PostgreSQL has). Each backend's folder is SQL and jobs above a line, and an engine below
//!   it that knows no table: SQLite (one process; `store::sqlite::engine` — a writer thread
//!   with group commit, its fsync pipelined on a thread of its own, each commit's WAL frames
//!   written in one call, outcomes nobody waits on taken into the next batch, its pace set by
//!   the load; the audit file's thread; the read-only connections the request path reads
//!   through on its own thread) and PostgreSQL (replicas, leases, NOTIFY;
//!   `store::postgres::engine` — statements batched many requests a round trip, and
//!   connections kept between statements). Beside the store, not in front of it: the replay cache
//!   (`store::replay`, which the request path consults in so many words; it also holds the
//!   answers given before their commit, which an operator's read waits for). Stored answers
//!   are sealed at rest (`store::seal`, AES-256-GCM) when an encryption key is set; a key's
//!   identity, shared and hashed once, is `store::id`.
//! - [`audit`]: the audit trail (batched, off the request path) and retention purging.
//! - [`admin`]: health, readiness and the operator API on the admin listener.
//! - [`console`]: the operators' HTML console on the admin listener (sign-in, needs attention,
//!   entity timelines, keys, overview), server-rendered with no script.
//! - [`settle`]: an operator settles a key by hand (release, or complete with the real
//!   answer), with the entity locks a request takes and an audit row with the note.
//! - [`ca`]: the egress listener's certificate authority: `idemproxy ca init/show`, and leaves
//!   minted per host.
//! - [`metrics`]: counters shared by the pipeline and the admin listener.
//! - [`error`]: the one error type of the request path and its mapping to JSON responses.
//! - [`error_format`]: the same errors in the shape of the API behind an upstream (Stripe,
//!   HubSpot, Zendesk), so each SDK raises its own typed error.
//! - [`redact`]: store URLs fit for logs, their passwords masked.
//! - [`logging`]: log lines and CLI output with control characters escaped (no forged
//!   lines, no terminal escapes from request data).
//! - [`fault`]: named fault points for the deterministic crash tests (the `faults` feature
//!   only; nothing without it).

#![deny(unsafe_op_in_unsafe_fn)]

pub mod admin;
pub mod audit;
pub mod ca;
pub mod cli;
pub mod config;
pub mod connection;
pub mod console;
pub mod error;
pub mod error_format;
pub mod fault;
pub mod key;
pub mod locks;
pub mod logging;
pub mod metrics;
pub mod pace;
pub mod pipeline;
pub mod redact;
pub mod reload;
pub mod rules;
pub mod scope_secret;
pub mod server;
pub mod settle;
pub mod state;
pub mod store;
pub mod threads;
pub mod upstream;
