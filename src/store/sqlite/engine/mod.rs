//! The SQLite writer as an engine that knows no tables: one thread that runs the jobs it is
//! given ([`job`]) in batched transactions ([`writer`], its loop in `writer_thread.rs`), paced
//! to the load ([`pace`]), outcomes nobody waits on taken into the next batch without waking
//! it ([`deferred`]), each commit made durable by a syncer thread of its own ([`durable`]),
//! its replies handed to each runtime in batches ([`inbox`]), and each commit's WAL frames
//! written in one call ([`walbuf`]). The tables' writes — keys,
//! entities, audit rows — are jobs their modules hand it.

pub(super) mod deferred;
pub(super) mod durable;
pub(super) mod inbox;
pub(super) mod job;
pub(super) mod pace;
pub(super) mod walbuf;
pub(super) mod writer;
