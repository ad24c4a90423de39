//! A request's body as the handlers see it: hyper's, plus a flag raised once it has been
//! read to its end — what decides whether an HTTP/1 connection may carry another request
//! (bytes of a body nobody read would be taken for the next request's head).

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

/// The next connection's number.
static NEXT_CONN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A number for a new connection, unique in this process (see [`RequestBody::conn`]).
pub fn number() -> u64 {
    NEXT_CONN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The body of a request the proxy serves.
#[derive(Debug)]
pub struct RequestBody {
    inner: Incoming,
    /// Raised when the body has been read to its end; `None` where nothing asks (HTTP/2,
    /// whose streams frame themselves).
    read: Option<Arc<AtomicBool>>,
    /// The connection it came on (numbered in this process): who the caller is, to pacing's
    /// fair queue.
    conn: u64,
}

impl RequestBody {
    /// `read` is raised once the body has been read to its end (at once, if it is empty).
    pub(super) fn tracked(inner: Incoming, read: Arc<AtomicBool>, conn: u64) -> RequestBody {
        let body = RequestBody {
            inner,
            read: Some(read),
            conn,
        };
        body.is_end_stream();
        body
    }

    /// A body whose end nobody needs to know.
    pub fn untracked(inner: Incoming, conn: u64) -> RequestBody {
        RequestBody {
            inner,
            read: None,
            conn,
        }
    }

    /// The number of the connection the request came on.
    pub fn conn(&self) -> u64 {
        self.conn
    }

    fn mark(&self) {
        if let Some(read) = &self.read {
            read.store(true, Ordering::Release);
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.mark(),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.mark(),
            _ => {}
        }
        polled
    }

    /// A consumer that stops at `is_end_stream` (hyper's client does) never polls the end.
    fn is_end_stream(&self) -> bool {
        let end = self.inner.is_end_stream();
        if end {
            self.mark();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
