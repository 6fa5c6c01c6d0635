//! Where a chunked request body ends, found as its bytes pass: so that the
//! guarded stream hands Pingora one request at a time and keeps what
//! follows (a pipelined request) for the next.
//!
//! The framing is read as strictly as the parsers that read it after us:
//! a chunk size as `httparse::parse_chunk_size` reads it (hex digits,
//! linear white space, extensions after `;`, then CRLF), CRLF after each
//! chunk's data, trailer lines ending in CRLF and an empty line at the end.
//! Anything else is an error: the stream then stops splitting and lets the
//! proxy's parser refuse the request, and the connection is not reused.

/// Hex digits a chunk size may have, as httparse allows.
const MAX_SIZE_DIGITS: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In a chunk-size line.
    Size {
        size: u64,
        digits: u32,
        /// Past the digits (white space or an extension).
        after_digits: bool,
        in_ext: bool,
    },
    /// After the CR of a chunk-size line.
    SizeLf { size: u64 },
    /// In a chunk's data.
    Data { left: u64 },
    /// Expecting the CR after a chunk's data.
    DataCr,
    /// Expecting the LF after a chunk's data.
    DataLf,
    /// At the start of a trailer line (or of the final empty line).
    TrailerStart,
    /// In a trailer line.
    Trailer,
    /// After the CR of a trailer line; `empty` when the line was empty.
    TrailerLf { empty: bool },
    /// The body is over.
    Done,
    /// The framing is broken.
    Broken,
}

/// Follows a chunked body's framing.
#[derive(Debug, Clone)]
pub struct Chunks {
    state: State,
    /// Trailer bytes seen, bounded.
    trailer_bytes: usize,
    max_trailer_bytes: usize,
}

impl Chunks {
    /// A body about to start; trailers may take `max_trailer_bytes`.
    pub fn new(max_trailer_bytes: usize) -> Self {
        Self {
            state: State::Size {
                size: 0,
                digits: 0,
                after_digits: false,
                in_ext: false,
            },
            trailer_bytes: 0,
            max_trailer_bytes,
        }
    }

    /// Whether the body ended.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Whether the framing broke.
    pub fn broken(&self) -> bool {
        self.state == State::Broken
    }

    /// Reads `bytes`, the body's next; how many of them belong to it (all
    /// of them, unless it ended inside them; all of them once broken).
    pub fn feed(&mut self, bytes: &[u8]) -> usize {
        let mut i = 0;
        while i < bytes.len() {
            match self.state {
                State::Done => return i,
                State::Broken => return bytes.len(),
                State::Data { left } => {
                    let take = (bytes.len() - i).min(usize::try_from(left).unwrap_or(usize::MAX));
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        State::DataCr
                    } else {
                        State::Data { left }
                    };
                }
                _ => {
                    self.state = self.step(bytes[i]);
                    i += 1;
                }
            }
        }
        if self.state == State::Broken {
            return bytes.len();
        }
        i
    }

    fn step(&mut self, b: u8) -> State {
        match self.state {
            State::Size {
                size,
                digits,
                after_digits,
                in_ext,
            } => match b {
                b'\r' if digits > 0 => State::SizeLf { size },
                b';' if !in_ext => State::Size {
                    size,
                    digits,
                    after_digits: true,
                    in_ext: true,
                },
                _ if in_ext => self.state,
                b'\t' | b' ' => State::Size {
                    size,
                    digits,
                    after_digits: true,
                    in_ext,
                },
                _ if after_digits => State::Broken,
                _ => match (b as char).to_digit(16) {
                    Some(d) if digits < MAX_SIZE_DIGITS => State::Size {
                        size: size.checked_mul(16).map_or(u64::MAX, |s| s + u64::from(d)),
                        digits: digits + 1,
                        after_digits,
                        in_ext,
                    },
                    _ => State::Broken,
                },
            },
            State::SizeLf { size } => match (b, size) {
                (b'\n', 0) => State::TrailerStart,
                (b'\n', left) => State::Data { left },
                _ => State::Broken,
            },
            State::DataCr if b == b'\r' => State::DataLf,
            State::DataLf if b == b'\n' => Self::new(self.max_trailer_bytes).state,
            State::TrailerStart | State::Trailer => {
                self.trailer_bytes += 1;
                match b {
                    _ if self.trailer_bytes > self.max_trailer_bytes => State::Broken,
                    b'\r' => State::TrailerLf {
                        empty: self.state == State::TrailerStart,
                    },
                    b'\n' => State::Broken,
                    _ => State::Trailer,
                }
            }
            State::TrailerLf { empty } if b == b'\n' => {
                if empty {
                    State::Done
                } else {
                    State::TrailerStart
                }
            }
            _ => State::Broken,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end_of(body: &[u8]) -> (usize, bool, bool) {
        let mut c = Chunks::new(1024);
        let n = c.feed(body);
        (n, c.done(), c.broken())
    }

    #[test]
    fn the_end_of_a_body_is_found_whatever_follows() {
        let next = b"GET /next HTTP/1.1\r\n\r\n";
        for body in [
            &b"0\r\n\r\n"[..],
            b"5\r\nhello\r\n0\r\n\r\n",
            b"5;name=v\r\nhello\r\nA \r\n0123456789\r\n0\r\n\r\n",
            b"3\r\nabc\r\n0\r\nx-usage: 7\r\ny: z\r\n\r\n",
            b"0000000000000005\r\nhello\r\n0\r\n\r\n",
        ] {
            let whole = [body, next].concat();
            assert_eq!(end_of(&whole), (body.len(), true, false), "{body:?}");
            // Byte by byte, the same place.
            let mut c = Chunks::new(1024);
            let mut taken = 0;
            for b in whole.chunks(1) {
                taken += c.feed(b);
                if c.done() {
                    break;
                }
            }
            assert_eq!(taken, body.len(), "{body:?} byte by byte");
        }
    }

    #[test]
    fn an_unfinished_body_takes_everything() {
        assert_eq!(end_of(b"5\r\nhel"), (6, false, false));
        assert_eq!(end_of(b"0\r\nx: y\r\n"), (9, false, false));
    }

    #[test]
    fn broken_framing_stops_the_splitting() {
        for body in [
            &b"zz\r\n"[..],
            b"5\nhello\r\n",
            b"5\r\nhelloX\r\n",
            b"\r\n",
            b"5 5\r\n",
            b"11111111111111111\r\n",
            b"0\r\nx: y\n\r\n",
            b"0\r\n\n",
        ] {
            let (n, done, broken) = end_of(body);
            assert_eq!((n, done, broken), (body.len(), false, true), "{body:?}");
        }
        let mut c = Chunks::new(4);
        c.feed(b"0\r\nlong-trailer\r\n\r\n");
        assert!(c.broken(), "trailers are bounded");
    }
}
