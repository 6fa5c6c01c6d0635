//! One client connection, guarded at the transport: the edge bounds (`server.limits`) that
//! hold whatever the request says, enforced under Pingora's HTTP parser.
//!
//! [`Guarded`] wraps the accepted stream. It reads a request head into its
//! own buffer, bounded in size (`max_header_bytes` → 431) and in time (from
//! the first byte, `header_read_ms` → 408), checks its framing with the same
//! parser Pingora uses (malformed, smuggling-prone framing → 400), and only
//! then hands it on. While a request body is due, a read that waits longer
//! than `body_read_ms`, a body slower on average than `body_min_rate` once
//! `body_grace_ms` passed, or one running past `body_total_ms` ends the
//! request (408 when nothing was answered yet); a write the client does not
//! take for `send_ms` fails it. Between requests a connection may idle for
//! `keepalive_idle_ms`, then it is closed quietly. Every failure is an I/O
//! error for the layers above, so the request ends and its pool permit is
//! dropped, whatever phase it was in.
//!
//! One request at a time: the proxy gets a request's head and its declared
//! body (a length counted down, a chunked body followed to its last chunk
//! by [`Chunks`]), never more. Bytes that follow are the next request's,
//! pipelined or sent early: they are kept, and checked as its head once
//! this request is over, exactly as a first request is. Its buffer grows
//! with what arrives, up to the head bound.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use pingora::protocols::{Peek, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::chunked::Chunks;
use super::listener::{Listener, Reason};
use super::EdgeSettings;
use crate::respond::Rejection;

/// How much of the request is still to come after its head.
#[derive(Debug, Clone)]
enum Body {
    /// No body, or all of it was read.
    Done,
    /// `content-length` bytes still to read.
    Length(u64),
    /// Chunked: done at its last chunk and trailers.
    Chunked(Chunks),
}

/// Bytes read into the head buffer at a time; a head's buffer starts at
/// this and doubles as needed, up to the head bound.
const CHUNK: usize = 4096;

#[derive(Debug)]
enum Phase {
    /// Waiting for a request's first byte; `fresh` on a new connection.
    Idle { fresh: bool },
    /// Reading a request head into `head`.
    Head,
    /// The head was handed on; the body (if any) and the response follow.
    Request,
    /// Writing an answer of our own, then closing.
    Answering(Bytes),
    /// Nothing more is read or written.
    Closed,
}

/// A timer armed for the wait in progress, if any.
///
/// Arming only notes the deadline: the tokio timer under it is moved only
/// when it would fire too late (the deadline came nearer) or when it fired
/// before the deadline (which had moved on). A keep-alive connection arms
/// its read timer twice a request, each time further on, and so moves the
/// timer in tokio's wheel about once per bound, not twice per request.
struct Timer {
    sleep: Pin<Box<Sleep>>,
    /// The deadline of the wait in progress.
    deadline: Option<Instant>,
    /// Times the sleep was moved, for the tests.
    #[cfg(test)]
    moves: usize,
}

impl Timer {
    fn new() -> Self {
        Self {
            sleep: Box::pin(tokio::time::sleep(Duration::ZERO)),
            deadline: None,
            #[cfg(test)]
            moves: 0,
        }
    }

    fn arm_at(&mut self, deadline: Instant) {
        self.deadline = Some(deadline);
    }

    /// Arms the timer `after` from now unless it is already running.
    fn arm(&mut self, after: Duration) {
        if self.deadline.is_none() {
            self.arm_at(Instant::now() + after);
        }
    }

    fn disarm(&mut self) {
        self.deadline = None;
    }

    /// Whether the deadline has passed; otherwise the task is woken by its
    /// time at the latest.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(deadline) = self.deadline else {
            return false;
        };
        if self.sleep.deadline() > deadline {
            self.move_to(deadline);
        }
        while self.sleep.as_mut().poll(cx).is_ready() {
            if Instant::now() >= deadline {
                return true;
            }
            // It fired for an earlier deadline than this one.
            self.move_to(deadline);
        }
        false
    }

    fn move_to(&mut self, deadline: Instant) {
        self.sleep.as_mut().reset(deadline);
        #[cfg(test)]
        {
            self.moves += 1;
        }
    }
}

/// The guarded client stream (see the module docs).
pub struct Guarded {
    inner: Stream,
    settings: EdgeSettings,
    listener: Arc<Listener>,
    phase: Phase,
    /// A request head being read, or bytes read ahead and not yet handed on.
    head: BytesMut,
    /// Bytes of `head` already looked at for the end of the head: it is
    /// parsed only when an end may have arrived, not after every read (a
    /// head sent a byte at a time must not cost a parse per byte).
    scanned: usize,
    /// A complete head and the part of its body that came with it, handed
    /// on before new reads.
    ready: Bytes,
    body: Body,
    /// When the proxy first asked for body bytes, and how many it got.
    body_started: Option<Instant>,
    body_bytes: u64,
    /// When the body last made progress.
    body_progress: Instant,
    /// Whether any byte of a response went out for this request.
    responded: bool,
    /// The connection was upgraded (101): bytes pass as they come.
    upgraded: bool,
    read_timer: Timer,
    write_timer: Timer,
    /// The response's bytes the client took once a write first waited on
    /// it (before, the socket's buffers took them, not the client), the
    /// time writes waited on it before, and since when the write in
    /// progress waits.
    sent: u64,
    send_waited: Duration,
    send_blocked: Option<Instant>,
    send_has_waited: bool,
}

impl std::fmt::Debug for Guarded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guarded")
            .field("inner", &self.inner)
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

impl Guarded {
    /// Guards a newly accepted connection.
    pub fn new(inner: Stream, settings: EdgeSettings, listener: Arc<Listener>) -> Self {
        let mut guarded = Self {
            inner,
            settings,
            listener,
            phase: Phase::Idle { fresh: true },
            head: BytesMut::new(),
            scanned: 0,
            ready: Bytes::new(),
            body: Body::Done,
            body_started: None,
            body_bytes: 0,
            body_progress: Instant::now(),
            responded: false,
            upgraded: false,
            read_timer: Timer::new(),
            write_timer: Timer::new(),
            sent: 0,
            send_waited: Duration::ZERO,
            send_blocked: None,
            send_has_waited: false,
        };
        let wait = guarded.settings.header_read;
        guarded.read_timer.arm_at(Instant::now() + wait);
        guarded
    }

    /// The previous request is over: wait for the next one under `settings`
    /// (the live policy's, which a reload may have changed).
    pub fn next_request(&mut self, settings: EdgeSettings) {
        self.settings = settings;
        // Bytes kept back (in `head`) are the next request's: they are
        // checked as its head, like bytes still to come. A body the proxy
        // left unread, or framing that could not be followed, leaves no
        // safe place to start the next request: the connection closes.
        let unsafe_to_reuse = !self.ready.is_empty()
            || self.body_due()
            || matches!(&self.body, Body::Chunked(c) if c.broken());
        self.phase = if unsafe_to_reuse {
            Phase::Closed
        } else {
            Phase::Idle { fresh: false }
        };
        self.body = Body::Done;
        self.body_started = None;
        self.body_bytes = 0;
        self.responded = false;
        self.write_timer.disarm();
        self.sent = 0;
        self.send_waited = Duration::ZERO;
        self.send_blocked = None;
        self.send_has_waited = false;
        self.read_timer
            .arm_at(Instant::now() + self.settings.keepalive_idle);
    }

    /// Waits until a complete, well-framed request head has arrived:
    /// `true`, or `false` when the connection ended first (the client
    /// left, a bound refused it and was answered, or it idled out). Until
    /// then the connection costs only this guard: the proxy's session, and
    /// the request's task state, are made once there is a request.
    pub async fn wait_head(&mut self) -> bool {
        let head = std::future::poll_fn(|cx| self.poll_head(cx)).await;
        matches!(head, Ok(true)) && matches!(self.phase, Phase::Request)
    }

    fn body_due(&self) -> bool {
        match &self.body {
            Body::Done => false,
            Body::Length(_) => true,
            Body::Chunked(chunks) => !chunks.done(),
        }
    }

    /// Ends the request with an answer of our own (when nothing was sent
    /// yet) and closes the connection.
    fn answer(&mut self, rejection: Option<Rejection>) {
        self.phase = match rejection {
            Some(r) if !self.responded => Phase::Answering(raw_response(&r)),
            _ => Phase::Closed,
        };
    }

    /// Reads what the client sent into `head`.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        // Not zeroed: a read that finds nothing (most polls) costs nothing.
        let mut chunk = [std::mem::MaybeUninit::<u8>::uninit(); CHUNK];
        let mut buf = ReadBuf::uninit(&mut chunk);
        ready!(Pin::new(&mut self.inner).poll_read(cx, &mut buf))?;
        let needed = self.head.len() + buf.filled().len();
        if needed > self.head.capacity() {
            // Grown with what arrives: one chunk, then doubling, never past
            // the head bound (and what overflows it is refused anyway), so
            // a connection holding a few KiB of a head costs a few KiB.
            let bound = self.settings.max_header_bytes + CHUNK;
            let target = needed
                .max(CHUNK)
                .max(self.head.capacity() * 2)
                .min(bound.max(needed));
            self.head.reserve(target - self.head.len());
        }
        self.head.extend_from_slice(buf.filled());
        Poll::Ready(Ok(buf.filled().len()))
    }

    /// Drives the read side until there are bytes to hand on, the client
    /// closed (`Ok(false)`), or the connection is done.
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            match &self.phase {
                Phase::Idle { fresh } => {
                    let fresh = *fresh;
                    if !self.head.is_empty() {
                        self.start_head();
                        continue;
                    }
                    match self.poll_fill(cx) {
                        Poll::Ready(Ok(0)) => return Poll::Ready(Ok(false)),
                        Poll::Ready(Ok(_)) => self.start_head(),
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending if self.read_timer.expired(cx) => {
                            let reason = if fresh {
                                Reason::HeaderTimeout
                            } else {
                                Reason::IdleTimeout
                            };
                            self.listener.rejected(reason);
                            self.phase = Phase::Closed;
                            return Poll::Ready(Ok(false));
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
                Phase::Head => match self.check_head_if_due() {
                    Some(Ok((body, n))) => {
                        self.read_timer.disarm();
                        self.start_request(body, n);
                        return Poll::Ready(Ok(true));
                    }
                    Some(Err((reason, rejection))) => {
                        self.listener.rejected(reason);
                        self.answer(Some(rejection));
                    }
                    None => match self.poll_fill(cx) {
                        Poll::Ready(Ok(0)) => {
                            // Closed mid-head: nothing to answer to.
                            self.phase = Phase::Closed;
                            return Poll::Ready(Ok(false));
                        }
                        Poll::Ready(Ok(_)) => {}
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending if self.read_timer.expired(cx) => {
                            self.listener.rejected(Reason::HeaderTimeout);
                            self.answer(Some(Rejection::RequestTimeout));
                        }
                        Poll::Pending => return Poll::Pending,
                    },
                },
                Phase::Answering(_) => {
                    ready!(self.poll_answer(cx))?;
                    return Poll::Ready(Ok(false));
                }
                Phase::Request | Phase::Closed => return Poll::Ready(Ok(true)),
            }
        }
    }

    /// A complete head of `n` bytes with `body`: what followed it in
    /// `head` is its body as far as the body goes, and the rest is kept
    /// for the next request.
    fn start_request(&mut self, body: Body, n: usize) {
        let early = &self.head[n..];
        let (body, taken) = match body {
            Body::Length(len) => {
                let taken = early.len().min(usize::try_from(len).unwrap_or(usize::MAX));
                let left = len - taken as u64;
                let body = if left == 0 {
                    Body::Done
                } else {
                    Body::Length(left)
                };
                (body, taken)
            }
            Body::Chunked(mut chunks) => {
                let taken = chunks.feed(early);
                (Body::Chunked(chunks), taken)
            }
            Body::Done => (Body::Done, 0),
        };
        self.body = body;
        let rest = self.head.split_off(n + taken);
        self.ready = std::mem::replace(&mut self.head, rest).freeze();
        self.phase = Phase::Request;
        self.body_progress = Instant::now();
    }

    fn start_head(&mut self) {
        self.phase = Phase::Head;
        self.scanned = 0;
        self.read_timer
            .arm_at(Instant::now() + self.settings.header_read);
    }

    /// [`Guarded::check_head`], when the bytes read since the last look may
    /// end the head (a blank line: `\n\n` or `\n\r\n`) or the head has
    /// outgrown its bound; `None` (read on) otherwise.
    fn check_head_if_due(&mut self) -> Option<Result<(Body, usize), (Reason, Rejection)>> {
        let from = self.scanned.saturating_sub(2);
        let fresh = &self.head[from..];
        // A head ends at an empty line: a line feed followed by another,
        // or by a carriage return and another.
        let may_end = memchr::memchr_iter(b'\n', fresh).any(|i| {
            let next = &fresh[i + 1..];
            next.first() == Some(&b'\n') || next.starts_with(b"\r\n")
        });
        self.scanned = self.head.len();
        if may_end || self.head.len() > self.settings.max_header_bytes {
            self.check_head()
        } else {
            None
        }
    }

    /// Whether `head` holds a complete, well-framed request head (its body
    /// and length): `None` while it may still grow.
    fn check_head(&self) -> Option<Result<(Body, usize), (Reason, Rejection)>> {
        let too_large = (Reason::HeaderTooLarge, Rejection::HeaderTooLarge);
        let mut headers = [httparse::EMPTY_HEADER; super::MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&self.head) {
            Ok(httparse::Status::Complete(n)) if n > self.settings.max_header_bytes => {
                Some(Err(too_large))
            }
            Ok(httparse::Status::Complete(n)) => Some(
                super::framing(
                    req.version.unwrap_or(1),
                    req.method.unwrap_or(""),
                    req.path.unwrap_or("").as_bytes(),
                    req.headers,
                )
                .map(|f| match f {
                    super::Framing::None => (Body::Done, n),
                    super::Framing::Length(len) => (Body::Length(len), n),
                    super::Framing::Chunked => (
                        Body::Chunked(Chunks::new(self.settings.max_header_bytes)),
                        n,
                    ),
                })
                .map_err(|detail| (Reason::BadRequest, Rejection::BadRequest { detail })),
            ),
            Ok(httparse::Status::Partial) if self.head.len() > self.settings.max_header_bytes => {
                Some(Err(too_large))
            }
            Ok(httparse::Status::Partial) => None,
            Err(httparse::Error::TooManyHeaders) => Some(Err(too_large)),
            Err(e) => Some(Err((
                Reason::BadRequest,
                Rejection::BadRequest {
                    detail: super::parse_error(e),
                },
            ))),
        }
    }

    /// Writes our own answer, then closes the write side.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Phase::Answering(rest) = &mut self.phase {
            if rest.is_empty() {
                let _ = ready!(Pin::new(&mut self.inner).poll_flush(cx));
                // A FIN after the answer, so the client reads it before the
                // connection goes.
                let _ = ready!(Pin::new(&mut self.inner).poll_shutdown(cx));
                self.phase = Phase::Closed;
                break;
            }
            match Pin::new(&mut self.inner).poll_write(cx, rest) {
                Poll::Ready(Ok(n)) if n > 0 => rest.advance(n),
                // A client that does not take the answer gets no more time.
                Poll::Ready(_) => self.phase = Phase::Closed,
                Poll::Pending if self.write_timer.expired(cx) => self.phase = Phase::Closed,
                Poll::Pending => {
                    self.write_timer.arm(self.settings.send);
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// A body read: at most what is left of the body, under the body's
    /// time bounds.
    fn poll_body(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let now = Instant::now();
        let started = *self.body_started.get_or_insert(now);
        let before = buf.filled().len();
        let read = match self.body {
            Body::Length(left) => {
                // Never past the body: what follows is the next request's.
                let room = buf
                    .remaining()
                    .min(usize::try_from(left).unwrap_or(usize::MAX));
                let mut part = ReadBuf::new(buf.initialize_unfilled_to(room));
                let read = Pin::new(&mut self.inner).poll_read(cx, &mut part);
                let n = part.filled().len();
                buf.advance(n);
                read
            }
            _ => Pin::new(&mut self.inner).poll_read(cx, buf),
        };
        match read {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                self.body_bytes += n as u64;
                self.body_progress = now;
                match &mut self.body {
                    Body::Length(left) => {
                        *left -= n as u64;
                        if *left == 0 {
                            self.body = Body::Done;
                        }
                    }
                    Body::Chunked(chunks) => {
                        let taken = chunks.feed(&buf.filled()[before..]);
                        if taken < n {
                            // The body ended inside this read: the rest is
                            // the next request's.
                            let rest = &buf.filled()[before + taken..];
                            self.head.extend_from_slice(rest);
                            buf.set_filled(before + taken);
                        }
                    }
                    Body::Done => {}
                }
                if n > 0 || !self.body_due() {
                    self.read_timer.disarm();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let (deadline, reason) = super::body::deadline(
                    &self.settings,
                    started,
                    self.body_progress,
                    self.body_bytes,
                );
                self.read_timer.arm_at(deadline);
                if !self.read_timer.expired(cx) {
                    return Poll::Pending;
                }
                self.listener.rejected(reason);
                self.answer(Some(Rejection::RequestTimeout));
                if let Phase::Answering(_) = self.phase {
                    ready!(self.poll_answer(cx))?;
                }
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "request body not received in time",
                )))
            }
        }
    }

    /// A read with no body due: bytes that come now are the next request's
    /// (pipelined), kept for it and not handed on; the proxy only learns
    /// of the client closing. When as much is kept as a head may hold,
    /// reading stops until this request is over.
    fn poll_keep(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if self.head.len() >= self.settings.max_header_bytes + CHUNK {
                return Poll::Pending;
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) => return Poll::Ready(Ok(())),
                Ok(_) => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Copies from the front of `from` into `buf`.
fn hand_on(from: &mut Bytes, buf: &mut ReadBuf<'_>) {
    let n = from.len().min(buf.remaining());
    buf.put_slice(&from[..n]);
    from.advance(n);
}

/// A complete HTTP/1.1 answer that closes the connection.
fn raw_response(rejection: &Rejection) -> Bytes {
    let body = rejection.body();
    let status = rejection.status();
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/problem+json\r\n\
         content-length: {}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out.into()
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !ready!(this.poll_head(cx))? {
            return Poll::Ready(Ok(()));
        }
        match this.phase {
            Phase::Closed => Poll::Ready(Ok(())),
            _ if !this.ready.is_empty() => {
                hand_on(&mut this.ready, buf);
                Poll::Ready(Ok(()))
            }
            // A tunnel: its bytes are no requests.
            _ if this.upgraded => Pin::new(&mut this.inner).poll_read(cx, buf),
            _ if this.body_due() => this.poll_body(cx, buf),
            _ => this.poll_keep(cx),
        }
    }
}

/// Whether `data` is an interim response head (1xx other than `101`),
/// whole.
fn is_interim(data: &[u8]) -> bool {
    data.len() > 12
        && data.starts_with(b"HTTP/1.1 1")
        && !data.starts_with(b"HTTP/1.1 101")
        && data.ends_with(b"\r\n\r\n")
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if matches!(this.phase, Phase::Answering(_) | Phase::Closed) {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        match Pin::new(&mut this.inner).poll_write(cx, data) {
            Poll::Ready(result) => {
                this.send_unblocked();
                if let Ok(n @ 1..) = result {
                    if this.send_has_waited {
                        this.sent += n as u64;
                    }
                    if !this.responded && data.starts_with(b"HTTP/1.1 101") {
                        // Switching protocols: what the client sent after
                        // its request is the tunnel's.
                        this.upgraded = true;
                        this.ready = this.head.split().freeze();
                        this.responded = true;
                    } else if !(this.responded || n == data.len() && is_interim(data)) {
                        // A whole interim answer (`100 Continue`) is no
                        // answer: a body that stalls after it is still
                        // answered 408.
                        this.responded = true;
                    }
                }
                Poll::Ready(result)
            }
            Poll::Pending => this.poll_send_stalled(cx),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Ready(result) => {
                this.send_unblocked();
                Poll::Ready(result)
            }
            Poll::Pending => this.poll_send_stalled(cx).map_ok(|_| ()),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Guarded {
    /// A write the client is not taking: pending until it has waited
    /// `send_ms` without progress, or the client has fallen below
    /// `send_min_rate` over the time writes waited on it, once that
    /// passed the grace ([`send_deadline`]).
    fn poll_send_stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let since = *self.send_blocked.get_or_insert_with(Instant::now);
        self.send_has_waited = true;
        let (deadline, reason) = send_deadline(&self.settings, since, self.send_waited, self.sent);
        self.write_timer.arm_at(deadline);
        if !self.write_timer.expired(cx) {
            return Poll::Pending;
        }
        self.listener.rejected(reason);
        self.phase = Phase::Closed;
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client did not read the response in time",
        )))
    }

    /// A write went through: the wait on the client, if any, is over.
    fn send_unblocked(&mut self) {
        self.write_timer.disarm();
        if let Some(since) = self.send_blocked.take() {
            self.send_waited += Instant::now().saturating_duration_since(since);
        }
    }
}

/// When a write that waits on its client since `since` fails, and which
/// bound that is: `send_ms` without progress (`SendTimeout`), or the rate
/// (`SendTooSlow`): the client took `sent` bytes over `waited` of earlier
/// waits, and may wait in all `sent / send_min_rate`, at least the grace.
/// Time the response spent waiting on the upstream is not the client's.
pub fn send_deadline(
    settings: &EdgeSettings,
    since: Instant,
    waited: Duration,
    sent: u64,
) -> (Instant, Reason) {
    let gap = since + settings.send;
    let slow = since + settings.send_allowance(sent).saturating_sub(waited);
    if gap <= slow {
        (gap, Reason::SendTimeout)
    } else {
        (slow, Reason::SendTooSlow)
    }
}

pass_through_to_inner!(Guarded);

/// Peeking would bypass the head checks: it is not offered.
impl Peek for Guarded {}

#[cfg(test)]
mod tests;
