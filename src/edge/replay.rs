//! A stream whose first bytes were already read, handed on as if they had
//! not been: the edge reads an h2 client's preface itself, within its
//! deadline, and the HTTP/2 server then reads it again from here.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use pingora::protocols::{Peek, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner` with `head` read back first.
pub struct Replayed {
    head: Bytes,
    inner: Stream,
}

impl Replayed {
    /// `inner`, whose reads start with `head` again.
    pub fn new(inner: Stream, head: Bytes) -> Self {
        Self { head, inner }
    }
}

impl std::fmt::Debug for Replayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayed")
            .field("head", &self.head.len())
            .finish_non_exhaustive()
    }
}

impl AsyncRead for Replayed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.head.is_empty() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let n = this.head.len().min(buf.remaining());
        buf.put_slice(&this.head[..n]);
        this.head.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Replayed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

pass_through_to_inner!(Replayed);

/// Nothing reads ahead of the HTTP/2 server.
impl Peek for Replayed {}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_head_is_read_again_then_the_stream() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let tcp: Stream = Box::new(pingora::protocols::l4::stream::Stream::from(server));
        let mut replayed = Replayed::new(tcp, Bytes::from_static(b"PRI "));
        client.write_all(b"rest").await.unwrap();
        drop(client);
        let mut all = Vec::new();
        replayed.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"PRI rest");
    }
}
