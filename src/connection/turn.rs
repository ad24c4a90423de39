//! One HTTP/1 exchange on a keep-alive connection, and how hyper is made to hand the socket
//! back after it. hyper keeps keep-alive on (so it writes no `Connection: close`) and is told to
//! close (`graceful_shutdown`, which closes an idle connection at once, without touching the
//! socket under `without_shutdown`) the moment it asks for the next request's head: that read
//! is caught here, before it reaches the socket.

use super::rewind::Rewind;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// How often a connection waiting for its next request checks whether one has begun since.
pub const GRACE: Duration = Duration::from_secs(1);

/// What one exchange has come to.
#[derive(Default)]
pub(super) struct Turn {
    /// The answer is out and the connection may carry another request.
    pub again: AtomicBool,
    /// hyper has since asked for more bytes: for the next request's head.
    pub asked: AtomicBool,
    /// hyper was told to close once already: reads go through from then on.
    pub told: AtomicBool,
    /// A request has begun since the last [`GRACE`] tick.
    pub busy: AtomicBool,
}

impl Turn {
    /// A new request on the connection: nothing decided yet.
    pub fn begin(&self) {
        self.again.store(false, Ordering::Release);
        self.busy.store(true, Ordering::Relaxed);
    }

    /// Whether hyper asked for the next head and is to be told to close (once only: should it
    /// ask again, it was not idle, and its reads go through to the socket).
    pub fn tell(&self) -> bool {
        self.asked.swap(false, Ordering::AcqRel) && !self.told.swap(true, Ordering::AcqRel)
    }
}

/// The connection's socket as hyper sees it during one exchange.
pub(super) struct Turned<I> {
    io: Rewind<I>,
    turn: Arc<Turn>,
    /// The [`GRACE`] ticks, from the first wait for a next request on.
    tick: Option<Pin<Box<Sleep>>>,
}

impl<I> Turned<I> {
    pub fn new(io: Rewind<I>, turn: Arc<Turn>) -> Turned<I> {
        Turned {
            io,
            turn,
            tick: None,
        }
    }

    /// Whether a whole tick has passed with no request begun (the waker is kept for the next).
    fn idled(&mut self, cx: &mut Context<'_>) -> bool {
        let tick = self
            .tick
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(GRACE)));
        while tick.as_mut().poll(cx).is_ready() {
            if !self.turn.busy.swap(false, Ordering::Relaxed) {
                return true;
            }
            tick.as_mut().reset(Instant::now() + GRACE);
        }
        false
    }

    pub fn into_inner(self) -> Rewind<I> {
        self.io
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Turned<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let waiting =
            self.turn.again.load(Ordering::Acquire) && !self.turn.told.load(Ordering::Acquire);
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if read.is_pending() && waiting && self.idled(cx) {
            // The caller re-polls the connection at once after telling it to close.
            self.turn.asked.store(true, Ordering::Release);
        }
        read
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Turned<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
