//! A hand-written HTTP/1.1 server for [`RecordingUpstream::builder().raw_http1()`]: it reads a
//! request head and its body (`content-length` or chunked), records it through the same path as
//! the hyper server, then answers, hangs, or drops the socket with nothing written — the
//! "processed, answer lost" case that hyper will not produce on demand.
//!
//! [`RecordingUpstream::builder().raw_http1()`]: super::upstream::UpstreamBuilder::raw_http1

use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::message::{Action, Recorded};
use super::upstream_server::Shared;

/// Requests bigger than this are not something a test sends; stop reading instead of growing.
const MAX_MESSAGE: usize = 64 * 1024 * 1024;

pub(crate) async fn serve<S>(mut stream: S, shared: Arc<Shared>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let Some(request) = read_request(&mut stream, &mut buf).await else {
            return; // EOF or garbage: the client went away
        };
        let close = request
            .headers
            .get(http::header::CONNECTION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
            || request.version == Version::HTTP_10;
        let (reply, seq, in_flight) = shared.admit(request).await;
        match reply.action {
            Action::Drop => {
                drop(in_flight);
                return; // dropping the stream closes the socket with no answer written
            }
            Action::Hang => {
                let _in_flight = in_flight;
                std::future::pending::<()>().await;
            }
            Action::Respond => {
                drop(in_flight);
                let status = StatusCode::from_u16(reply.status)
                    .unwrap_or_else(|e| panic!("scripted status {}: {e}", reply.status));
                let mut head = format!(
                    "HTTP/1.1 {} {}\r\n",
                    status.as_u16(),
                    status.canonical_reason().unwrap_or("Unknown")
                );
                for (name, value) in reply.header_map(seq).iter() {
                    head.push_str(name.as_str());
                    head.push_str(": ");
                    head.push_str(value.to_str().unwrap_or_default());
                    head.push_str("\r\n");
                }
                head.push_str(&format!("content-length: {}\r\n", reply.body.len()));
                if close {
                    head.push_str("connection: close\r\n");
                }
                head.push_str("\r\n");
                let written = async {
                    stream.write_all(head.as_bytes()).await?;
                    stream.write_all(&reply.body).await?;
                    stream.flush().await
                };
                if written.await.is_err() || close {
                    return;
                }
            }
        }
    }
}

/// Reads one request from `stream`, keeping any bytes past it in `buf` for the next one.
async fn read_request<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut Vec<u8>) -> Option<Recorded> {
    let head_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i;
        }
        fill(stream, buf).await?;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    buf.drain(..head_end + 4);

    let mut lines = head.split("\r\n");
    let mut request_line = lines.next()?.split(' ');
    let method = Method::from_bytes(request_line.next()?.as_bytes()).ok()?;
    let target = request_line.next()?.to_string();
    let version = match request_line.next()? {
        "HTTP/1.0" => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':')?;
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).ok()?,
            HeaderValue::from_str(value.trim()).ok()?,
        );
    }

    let chunked = headers
        .get(http::header::TRANSFER_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        read_chunked(stream, buf).await?
    } else {
        let len: usize = headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < len {
            fill(stream, buf).await?;
        }
        buf.drain(..len).collect()
    };

    let (path_and_query, authority) = match target.split_once("://") {
        // absolute-form: keep the origin-form part, the authority comes from the target
        Some((_, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let path = if path.is_empty() { "/" } else { path };
            (path.to_string(), Some(authority.to_string()))
        }
        None => (target, None),
    };
    let authority = authority.or_else(|| {
        headers
            .get(http::header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    });
    Some(Recorded {
        seq: 0,
        method,
        path_and_query,
        authority,
        headers,
        body: body.into(),
        version,
    })
}

async fn read_chunked<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(i) = find(buf, b"\r\n") {
                break i;
            }
            fill(stream, buf).await?;
        };
        let size_text = String::from_utf8_lossy(&buf[..line_end]).into_owned();
        let size_hex = size_text.split(';').next()?.trim();
        let size = usize::from_str_radix(size_hex, 16).ok()?;
        buf.drain(..line_end + 2);
        if size == 0 {
            // trailers, then an empty line
            loop {
                let end = loop {
                    if let Some(i) = find(buf, b"\r\n") {
                        break i;
                    }
                    fill(stream, buf).await?;
                };
                buf.drain(..end + 2);
                if end == 0 {
                    return Some(body);
                }
            }
        }
        while buf.len() < size + 2 {
            fill(stream, buf).await?;
        }
        body.extend_from_slice(&buf[..size]);
        buf.drain(..size + 2);
    }
}

/// Reads more bytes into `buf`; `None` on EOF, error, or an oversized message.
async fn fill<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut Vec<u8>) -> Option<()> {
    if buf.len() > MAX_MESSAGE {
        return None;
    }
    let mut chunk = [0u8; 8192];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

pub(crate) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
