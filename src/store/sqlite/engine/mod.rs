//! Below the line: the SQLite engine, which knows no table. The tables' writes — keys,
//! entities, audit rows — are jobs their modules hand it ([`job`]); it runs them on one writer
//! thread in batched transactions ([`writer`], its loop in `writer_thread.rs`), paced to the
//! load ([`pace`]), outcomes nobody waits on taken into the next batch without waking it
//! ([`deferred`]), each commit made durable by a syncer thread of its own ([`durable`]), its
//! replies handed to each runtime in batches ([`inbox`]), and each commit's WAL frames written
//! in one call ([`walbuf`], a VFS). Beside the writer: the audit file's thread, which runs its
//! jobs in turns and its by-key merge now and then ([`trail`]), and the read-only connections
//! the request path reads through on its own thread ([`reader`]).
//!
//! A first write's reservation crosses it thus: the caller (a serving thread) hands the job to
//! the writer's queue; the writer thread runs it in the next batch and commits; the syncer
//! thread `fdatasync`s the WAL; the reply goes back through the caller's runtime's inbox.

pub(super) mod deferred;
pub(super) mod durable;
pub(super) mod inbox;
pub(super) mod job;
pub(super) mod pace;
pub(super) mod reader;
pub(super) mod trail;
pub(super) mod walbuf;
pub(super) mod writer;
