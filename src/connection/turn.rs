//! One HTTP/1 exchange on a keep-alive connection, and how hyper is made to hand the socket
//! back after it. hyper keeps keep-alive on (so it writes no `Connection: close`) and is told to
//! close (`graceful_shutdown`, which closes an idle connection at once, without touching the
//! socket under `without_shutdown`) the moment it asks for the next request's head: that read
//! is caught here, before it reaches the socket.

use super::rewind::Rewind;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What one exchange has come to.
#[derive(Default)]
pub(super) struct Turn {
    /// The request's body has been read to its end (see [`super::RequestBody`]).
    pub read: Arc<AtomicBool>,
    /// The answer is out and the connection may carry another request.
    pub again: AtomicBool,
    /// hyper has since asked for more bytes: for the next request's head.
    pub asked: AtomicBool,
    /// hyper was told to close once already: reads go through from then on.
    pub told: AtomicBool,
}

impl Turn {
    /// A new request on the connection: nothing decided yet.
    pub fn begin(&self) {
        self.read.store(false, Ordering::Release);
        self.again.store(false, Ordering::Release);
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
}

impl<I> Turned<I> {
    pub fn new(io: Rewind<I>, turn: Arc<Turn>) -> Turned<I> {
        Turned { io, turn }
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
        // The caller re-polls the connection at once after telling it to close (see `tell`).
        let turn = &self.turn;
        if turn.again.load(Ordering::Acquire) && !turn.told.load(Ordering::Acquire) {
            turn.asked.store(true, Ordering::Release);
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
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
