//! Bytes copied both ways between two connections (a tunnel), holding no buffer while
//! neither side has anything to say: a read lands in a buffer on the stack of the poll and is
//! written on at once; only what the other side cannot take yet is kept on the heap, until it
//! can. (tokio's `copy_bidirectional` keeps 8 KiB each way for the tunnel's whole life.)

use bytes::{Buf, Bytes};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Copies `a` to `b` and `b` to `a` until both have ended; each side's end is passed on as a
/// write shutdown of the other.
pub async fn splice<A, B>(a: &mut A, b: &mut B) -> io::Result<()>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut there, mut back) = (Direction::default(), Direction::default());
    std::future::poll_fn(|cx| {
        let one = there.poll(cx, &mut *a, &mut *b)?;
        let two = back.poll(cx, &mut *b, &mut *a)?;
        match (one, two) {
            (Poll::Ready(()), Poll::Ready(())) => Poll::Ready(Ok(())),
            _ => Poll::Pending,
        }
    })
    .await
}

/// One way of a tunnel.
#[derive(Default)]
struct Direction {
    /// Read, not yet taken by the writer.
    held: Bytes,
    /// Written since the last flush.
    unflushed: bool,
    /// The reader has ended.
    ended: bool,
    /// The writer has been shut down after the reader's end.
    done: bool,
}

impl Direction {
    fn poll<R, W>(&mut self, cx: &mut Context<'_>, r: &mut R, w: &mut W) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        loop {
            while !self.held.is_empty() {
                let n = ready!(Pin::new(&mut *w).poll_write(cx, &self.held))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.held.advance(n);
                self.unflushed = true;
            }
            if self.ended {
                ready!(Pin::new(&mut *w).poll_shutdown(cx))?;
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            let mut stack = [0u8; 16 * 1024];
            let mut buf = ReadBuf::new(&mut stack);
            if Pin::new(&mut *r).poll_read(cx, &mut buf)?.is_pending() {
                if self.unflushed {
                    ready!(Pin::new(&mut *w).poll_flush(cx))?;
                    self.unflushed = false;
                }
                return Poll::Pending;
            }
            let read = buf.filled();
            if read.is_empty() {
                self.ended = true;
                continue;
            }
            let mut at = 0;
            while at < read.len() {
                match Pin::new(&mut *w).poll_write(cx, &read[at..])? {
                    Poll::Ready(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(n) => {
                        at += n;
                        self.unflushed = true;
                    }
                    Poll::Pending => {
                        self.held = Bytes::copy_from_slice(&read[at..]);
                        return Poll::Pending;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Far more than a pipe holds, both ways at once: every byte arrives, in order, and each
    /// side's end reaches the other.
    #[tokio::test]
    async fn copies_both_ways_to_the_end() {
        let (a, mut near) = tokio::io::duplex(1024);
        let (mut far, b) = tokio::io::duplex(1024);
        let tunnel = tokio::spawn(async move { splice(&mut near, &mut far).await });
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let (sent_a, sent_b) = (data.clone(), data.clone());
        let (mut ar, mut aw) = tokio::io::split(a);
        let (mut br, mut bw) = tokio::io::split(b);
        let writes = tokio::spawn(async move {
            aw.write_all(&sent_a).await.unwrap();
            aw.shutdown().await.unwrap();
            bw.write_all(&sent_b).await.unwrap();
            bw.shutdown().await.unwrap();
        });
        let (mut got_b, mut got_a) = (Vec::new(), Vec::new());
        let (x, y) = tokio::join!(br.read_to_end(&mut got_b), ar.read_to_end(&mut got_a));
        x.unwrap();
        y.unwrap();
        writes.await.unwrap();
        tunnel.await.unwrap().unwrap();
        assert_eq!(got_b, data);
        assert_eq!(got_a, data);
    }
}
