//! The ledger's spool: records appended to segment files on local disk
//! before any sink sees them, so that what was admitted is not lost with a
//! sink, a network or Redis.
//!
//! A segment is a file of JSON lines named by its sequence number
//! (`00000000000000000001.seg`), mode 0600 in a directory of mode 0700.
//! The request path appends a record to a buffer in memory; every
//! `fsync_ms` one writer moves the buffer to the segment and calls fsync
//! (so a crash loses at most that much, and a request never waits for the
//! disk); each sink
//! reads from its own position (`cursor.N`, rewritten atomically after
//! each batch it shipped), and a segment every sink has passed is deleted.
//! At start the last segment is checked: a record cut short by a crash
//! (no newline, or not JSON) is cut off, counted and logged, and writing
//! goes on in a new segment.
//!
//! The spool holds at most `max_bytes`: with `on_full: refuse` the
//! request path reserves a record's room ([`Spool::reserve`]) before any
//! limit is charged, so an admitted request always has room; with `drop`
//! the oldest segment goes, and the records no sink had shipped from it
//! are counted.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The room reserved for one record: the most a record takes.
pub const RECORD_ROOM: u64 = 8 << 10;

/// Records read from the spool, in one buffer as the segment holds them
/// (a batch of hundreds is one allocation and one copy, not one a record).
#[derive(Debug, Default)]
pub struct Lines {
    bytes: Vec<u8>,
    /// Where each line's newline is in `bytes`.
    ends: Vec<usize>,
}

/// How much of a segment is read at a time.
const READ_CHUNK: usize = 64 << 10;

impl Lines {
    /// How many.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Each line, without its newline, in the spool's order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().map(|&end| end + 1));
        starts
            .zip(&self.ends)
            .map(|(start, &end)| &self.bytes[start..end])
    }

    /// The first line.
    pub fn first(&self) -> Option<&[u8]> {
        self.iter().next()
    }

    /// Their bytes in all, newlines included.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Reads whole lines of `file` from where it is, until `most` more
    /// are in or the file ends; a last line not ended yet is left. The
    /// bytes taken, newlines included.
    fn read_from(&mut self, file: &mut impl Read, most: usize) -> io::Result<u64> {
        let (start, wanted) = (self.bytes.len(), self.len() + most);
        while self.len() < wanted {
            let from = self.bytes.len();
            self.bytes.resize(from + READ_CHUNK, 0);
            let n = match file.read(&mut self.bytes[from..]) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    self.bytes.truncate(from);
                    return Err(e);
                }
            };
            self.bytes.truncate(from + n);
            if n == 0 {
                break;
            }
            let newlines = memchr::memchr_iter(b'\n', &self.bytes[from..]).map(|i| from + i);
            self.ends.extend(newlines.take(wanted - self.ends.len()));
        }
        // Only whole lines, and no more than wanted.
        let end = self
            .ends
            .last()
            .map_or(start, |&newline| newline + 1)
            .max(start);
        self.bytes.truncate(end);
        Ok((end - start) as u64)
    }
}

/// A position in the spool: a segment and a byte offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Position {
    /// The segment's sequence number.
    pub segment: u64,
    /// Bytes into it.
    pub offset: u64,
}

/// What the spool found at start.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Records cut short by a crash, cut off.
    pub torn: u64,
    /// Bytes it holds.
    pub bytes: u64,
}

/// The spool, shared by its writer, its sinks and the request path.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    segment_bytes: u64,
    drop_oldest: bool,
    state: Mutex<State>,
    /// Held while the buffer is written out: one writer at a time, so
    /// that records reach the files in order.
    writing: Mutex<()>,
    /// Bytes of segment files, of the buffer, and reserved.
    used: AtomicU64,
    /// Records dropped (`on_full: drop`).
    dropped: AtomicU64,
    /// Signalled when records are appended.
    appended: Condvar,
    /// Each sink's position, as persisted.
    cursors: Vec<Mutex<Position>>,
}

#[derive(Debug)]
struct State {
    /// Segments on disk, oldest first, with their sizes.
    segments: VecDeque<(u64, u64)>,
    /// The segment written to.
    out: Arc<File>,
    /// Records appended and not yet written.
    pending: Vec<u8>,
}

/// Room for one record, reserved on the request path; given back when
/// dropped (the record written, or never made).
#[derive(Debug)]
pub struct Room {
    spool: Arc<Spool>,
}

impl Drop for Room {
    fn drop(&mut self) {
        self.spool.used.fetch_sub(RECORD_ROOM, Ordering::AcqRel);
    }
}

fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:020}.seg"))
}

fn cursor_path(dir: &Path, sink: usize) -> PathBuf {
    dir.join(format!("cursor.{sink}"))
}

/// Where a sink's cursor is written before it replaces the last one: one
/// file per sink, so that sinks advancing at once never share it.
fn cursor_tmp_path(dir: &Path, sink: usize) -> PathBuf {
    dir.join(format!("cursor.{sink}.tmp"))
}

impl Spool {
    /// Opens (or creates) the spool at `dir` for `sinks` sinks, recovering
    /// what a previous process left.
    pub fn open(
        dir: &Path,
        max_bytes: u64,
        drop_oldest: bool,
        sinks: usize,
    ) -> io::Result<(Arc<Self>, Recovered)> {
        fs::create_dir_all(dir)?;
        set_mode(dir, 0o700)?;
        let mut seqs: Vec<u64> = fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_suffix(".seg")?.parse().ok()
            })
            .collect();
        seqs.sort_unstable();
        let mut recovered = Recovered::default();
        if let Some(&last) = seqs.last() {
            recovered.torn = cut_torn_tail(&segment_path(dir, last))?;
        }
        let mut segments = VecDeque::new();
        for &seq in &seqs {
            let len = fs::metadata(segment_path(dir, seq))?.len();
            recovered.bytes += len;
            segments.push_back((seq, len));
        }
        let next = seqs.last().map_or(1, |s| s + 1);
        let out = Arc::new(create_segment(dir, next)?);
        segments.push_back((next, 0));
        let first = segments.front().map_or(next, |s| s.0);
        let cursors = (0..sinks)
            .map(|i| {
                let at = read_cursor(&cursor_path(dir, i)).unwrap_or(Position {
                    segment: first,
                    offset: 0,
                });
                // A cursor behind every segment (they were dropped) starts
                // at the oldest.
                Mutex::new(at.max(Position {
                    segment: first,
                    offset: 0,
                }))
            })
            .collect();
        let spool = Arc::new(Self {
            dir: dir.to_path_buf(),
            max_bytes,
            // Eight segments or more, so that dropping the oldest frees an
            // eighth at most.
            segment_bytes: (max_bytes / 8).clamp(RECORD_ROOM, 64 << 20),
            drop_oldest,
            state: Mutex::new(State {
                segments,
                out,
                pending: Vec::new(),
            }),
            writing: Mutex::new(()),
            used: AtomicU64::new(recovered.bytes),
            dropped: AtomicU64::new(0),
            appended: Condvar::new(),
            cursors,
        });
        spool.collect();
        Ok((spool, recovered))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Room for one record, unless the spool is full (`on_full: refuse`
    /// refuses the request then).
    pub fn reserve(self: &Arc<Self>) -> Option<Room> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + RECORD_ROOM <= self.max_bytes).then_some(used + RECORD_ROOM)
            })
            .ok()?;
        Some(Room {
            spool: self.clone(),
        })
    }

    /// Appends one record's line, to be written out by [`Spool::sync`].
    /// With `drop`, the oldest segments go to make room; with `refuse` the
    /// room was reserved.
    pub fn append(&self, line: &[u8]) -> io::Result<()> {
        let len = line.len() as u64;
        let mut state = self.lock();
        if self.drop_oldest {
            while self.used.load(Ordering::Acquire) + len > self.max_bytes {
                if !self.drop_oldest_segment(&mut state)? {
                    break;
                }
            }
        }
        state.pending.extend_from_slice(line);
        self.used.fetch_add(len, Ordering::AcqRel);
        Ok(())
    }

    /// Writes what was appended to the current segment (starting a new
    /// one when it is full) and makes it durable; the sinks see it then.
    /// The disk is written without the lock appends take.
    pub fn sync(&self) -> io::Result<()> {
        let _writing = self.writing.lock().unwrap_or_else(|e| e.into_inner());
        let (out, pending) = {
            let mut state = self.lock();
            if state.pending.is_empty() {
                return Ok(());
            }
            let (seq, size) = *state.segments.back().expect("a current segment");
            if size >= self.segment_bytes {
                let next = seq + 1;
                state.out = Arc::new(create_segment(&self.dir, next)?);
                state.segments.push_back((next, 0));
            }
            (state.out.clone(), std::mem::take(&mut state.pending))
        };
        (&*out).write_all(&pending)?;
        out.sync_data()?;
        {
            let mut state = self.lock();
            if let Some(last) = state.segments.back_mut() {
                last.1 += pending.len() as u64;
            }
            // The buffer's allocation is kept for the next records.
            if state.pending.is_empty() {
                let mut pending = pending;
                pending.clear();
                state.pending = pending;
            }
        }
        self.appended.notify_all();
        Ok(())
    }

    /// Deletes the oldest segment (never the one written to), counting the
    /// records no sink had shipped from it. `false` when there is none.
    fn drop_oldest_segment(&self, state: &mut State) -> io::Result<bool> {
        if state.segments.len() < 2 {
            return Ok(false);
        }
        let (seq, len) = state.segments.pop_front().expect("two segments");
        let slowest = self.slowest();
        if slowest.segment <= seq {
            let from = if slowest.segment == seq {
                slowest.offset
            } else {
                0
            };
            let lost = count_lines(&segment_path(&self.dir, seq), from)?;
            self.dropped.fetch_add(lost, Ordering::AcqRel);
        }
        let _ = fs::remove_file(segment_path(&self.dir, seq));
        self.used.fetch_sub(len, Ordering::AcqRel);
        Ok(true)
    }

    fn slowest(&self) -> Position {
        self.cursors
            .iter()
            .map(|c| *c.lock().unwrap_or_else(|e| e.into_inner()))
            .min()
            .unwrap_or(Position {
                segment: u64::MAX,
                offset: 0,
            })
    }

    /// Deletes the segments every sink has passed.
    pub fn collect(&self) {
        let slowest = self.slowest();
        let mut state = self.lock();
        while state.segments.len() > 1 && state.segments[0].0 < slowest.segment {
            let (seq, len) = state.segments.pop_front().expect("checked");
            let _ = fs::remove_file(segment_path(&self.dir, seq));
            self.used.fetch_sub(len, Ordering::AcqRel);
        }
    }

    /// Bytes held on disk and reserved.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Records dropped to make room, since start.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Acquire)
    }

    /// Up to `most` whole records after `sink`'s position, and the
    /// position after them; waits up to `wait` for one when there is none.
    pub fn read(&self, sink: usize, most: usize, wait: Duration) -> io::Result<(Lines, Position)> {
        let mut at = *self.cursors[sink].lock().unwrap_or_else(|e| e.into_inner());
        let first = self.read_at(&mut at, most)?;
        if !first.is_empty() || wait.is_zero() {
            return Ok((first, at));
        }
        let state = self.lock();
        drop(self.appended.wait_timeout(state, wait));
        let again = self.read_at(&mut at, most)?;
        Ok((again, at))
    }

    fn read_at(&self, at: &mut Position, most: usize) -> io::Result<Lines> {
        let mut out = Lines::default();
        loop {
            let (oldest, newest) = {
                let state = self.lock();
                (
                    state.segments.front().map_or(at.segment, |s| s.0),
                    state.segments.back().map_or(at.segment, |s| s.0),
                )
            };
            if at.segment < oldest {
                // Dropped while this sink was behind: go on from the oldest.
                *at = Position {
                    segment: oldest,
                    offset: 0,
                };
            }
            let path = segment_path(&self.dir, at.segment);
            let file = match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound && at.segment < newest => {
                    *at = Position {
                        segment: at.segment + 1,
                        offset: 0,
                    };
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
                Err(e) => return Err(e),
            };
            let mut file = file;
            file.seek(SeekFrom::Start(at.offset))?;
            at.offset += out.read_from(&mut file, most - out.len())?;
            // A segment is complete once a newer one exists: its end is
            // the end of its records.
            if out.len() < most && at.segment < newest {
                let len = fs::metadata(&path)?.len();
                if at.offset >= len {
                    *at = Position {
                        segment: at.segment + 1,
                        offset: 0,
                    };
                    continue;
                }
            }
            return Ok(out);
        }
    }

    /// Records that `sink` shipped everything before `at`: persisted, so
    /// that a restart does not ship it again (a crash between shipping
    /// and this may: sinks are at least once).
    pub fn advance(&self, sink: usize, at: Position) -> io::Result<()> {
        let path = cursor_path(&self.dir, sink);
        let tmp = cursor_tmp_path(&self.dir, sink);
        {
            let mut f = create_private(&tmp)?;
            writeln!(f, "{} {}", at.segment, at.offset)?;
            f.sync_data()?;
        }
        fs::rename(&tmp, &path)?;
        *self.cursors[sink].lock().unwrap_or_else(|e| e.into_inner()) = at;
        self.collect();
        Ok(())
    }

    /// Whether `sink` has shipped everything written.
    pub fn caught_up(&self, sink: usize) -> bool {
        let at = *self.cursors[sink].lock().unwrap_or_else(|e| e.into_inner());
        let state = self.lock();
        state.segments.back().is_some_and(|&(seq, len)| {
            at >= Position {
                segment: seq,
                offset: len,
            }
        })
    }
}

fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
}

fn create_private(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

fn create_segment(dir: &Path, seq: u64) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(segment_path(dir, seq))?;
    // The new file's name is durable with its directory.
    File::open(dir)?.sync_all()?;
    Ok(file)
}

fn read_cursor(path: &Path) -> Option<Position> {
    let text = fs::read_to_string(path).ok()?;
    let mut words = text.split_whitespace();
    Some(Position {
        segment: words.next()?.parse().ok()?,
        offset: words.next()?.parse().ok()?,
    })
}

/// Cuts a record a crash left incomplete off the end of `path`: bytes
/// after the last newline, or a last line that is not JSON. Returns how
/// many were cut (0 or 1).
fn cut_torn_tail(path: &Path) -> io::Result<u64> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    let mut keep = bytes.len();
    let mut torn = 0;
    if bytes.last().is_some_and(|&b| b != b'\n') {
        keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        torn = 1;
    } else if keep > 0 {
        let start = bytes[..keep - 1]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        if serde_json::from_slice::<serde_json::Value>(&bytes[start..keep - 1]).is_err() {
            keep = start;
            torn = 1;
        }
    }
    if torn > 0 {
        OpenOptions::new()
            .write(true)
            .open(path)?
            .set_len(keep as u64)?;
    }
    Ok(torn)
}

fn count_lines(path: &Path, from: u64) -> io::Result<u64> {
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    file.seek(SeekFrom::Start(from))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes.iter().filter(|&&b| b == b'\n').count() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(i: usize) -> Vec<u8> {
        format!("{{\"id\":\"r{i}\",\"pad\":\"{}\"}}\n", "x".repeat(100)).into_bytes()
    }

    fn ids(lines: &Lines) -> Vec<String> {
        lines
            .iter()
            .map(|l| {
                serde_json::from_slice::<serde_json::Value>(l).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    #[test]
    fn records_are_read_in_order_across_segments_and_resumed_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, _) = Spool::open(dir.path(), 1 << 20, false, 2).unwrap();
        // Segments of 128 KiB: 3000 lines of ~118 bytes fill three.
        for i in 0..3000 {
            spool.append(&line(i)).unwrap();
            if i % 100 == 99 {
                spool.sync().unwrap();
            }
        }
        spool.sync().unwrap();
        let segments = fs::read_dir(dir.path()).unwrap().filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "seg")
        });
        assert!(segments.count() >= 2);
        let (first, at) = spool.read(0, 600, Duration::ZERO).unwrap();
        assert_eq!(ids(&first)[..2], ["r0", "r1"]);
        assert_eq!(first.len(), 600);
        spool.advance(0, at).unwrap();
        drop(spool);

        // A restart resumes each sink where it was.
        let (spool, recovered) = Spool::open(dir.path(), 1 << 20, false, 2).unwrap();
        assert_eq!(recovered.torn, 0);
        let (rest, at) = spool.read(0, 3000, Duration::ZERO).unwrap();
        assert_eq!(rest.len(), 2400);
        assert_eq!(ids(&rest)[0], "r600");
        spool.advance(0, at).unwrap();
        assert!(spool.caught_up(0));
        let (all, at) = spool.read(1, 5000, Duration::ZERO).unwrap();
        assert_eq!(all.len(), 3000, "the other sink from the start");
        spool.advance(1, at).unwrap();
        // Every sink passed the old segments: they are gone.
        let left: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "seg"))
            .collect();
        assert_eq!(left.len(), 1, "only the segment written to");
    }

    #[test]
    fn lines_are_read_whole_however_long_and_no_more_than_asked() {
        let long = "x".repeat(3 * READ_CHUNK);
        let text = format!("a\n{long}\nb\nc\nunended");
        let mut file = std::io::Cursor::new(text.as_bytes());
        let mut lines = Lines::default();
        assert_eq!(
            lines.read_from(&mut file, 2).unwrap(),
            2 + long.len() as u64 + 1
        );
        let read: Vec<&[u8]> = lines.iter().collect();
        assert_eq!(read, [&b"a"[..], long.as_bytes()]);
        // The rest, from where the last whole line ended.
        file.set_position(2 + long.len() as u64 + 1);
        assert_eq!(lines.read_from(&mut file, 10).unwrap(), 4);
        let read: Vec<&[u8]> = lines.iter().collect();
        assert_eq!(read, [&b"a"[..], long.as_bytes(), b"b", b"c"]);
        assert_eq!(lines.first(), Some(&b"a"[..]));
        assert_eq!(lines.read_from(&mut file, 10).unwrap(), 0, "unended: left");
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn a_record_cut_short_by_a_crash_is_cut_off_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, _) = Spool::open(dir.path(), 1 << 20, false, 1).unwrap();
        spool.append(&line(0)).unwrap();
        spool.append(&line(1)).unwrap();
        spool.sync().unwrap();
        drop(spool);
        let seg = segment_path(dir.path(), 1);
        let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
        f.write_all(b"{\"id\":\"r2\",\"pa").unwrap();
        drop(f);
        let (spool, recovered) = Spool::open(dir.path(), 1 << 20, false, 1).unwrap();
        assert_eq!(recovered.torn, 1);
        let (lines, _) = spool.read(0, 10, Duration::ZERO).unwrap();
        assert_eq!(ids(&lines), ["r0", "r1"]);
        // A last line ended by a newline but not JSON is torn too.
        spool.append(b"{\"id\":\n").unwrap();
        spool.sync().unwrap();
        drop(spool);
        let (_, recovered) = Spool::open(dir.path(), 1 << 20, false, 1).unwrap();
        assert_eq!(recovered.torn, 1);
    }

    #[test]
    fn a_full_spool_refuses_room_or_drops_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        // refuse: room is reserved, and given back.
        let (spool, _) = Spool::open(&dir.path().join("refuse"), 1 << 20, false, 1).unwrap();
        let rooms: Vec<_> = (0..128).map_while(|_| spool.reserve()).collect();
        assert_eq!(rooms.len(), 128, "1 MiB holds 128 rooms of 8 KiB");
        assert!(spool.reserve().is_none());
        drop(rooms);
        assert_eq!(spool.used(), 0);
        assert!(spool.reserve().is_some());

        // drop: the oldest segment goes, its unshipped records counted.
        let (spool, _) = Spool::open(&dir.path().join("drop"), 1 << 20, true, 1).unwrap();
        let n = 20_000;
        for i in 0..n {
            spool.append(&line(i)).unwrap();
            if i % 100 == 99 {
                spool.sync().unwrap();
            }
        }
        spool.sync().unwrap();
        assert!(spool.used() <= 1 << 20);
        let (kept, _) = spool.read(0, n, Duration::ZERO).unwrap();
        assert_eq!(
            kept.len() as u64 + spool.dropped(),
            n as u64,
            "every record kept or counted"
        );
        assert_eq!(
            ids(&kept).last().unwrap(),
            &format!("r{}", n - 1),
            "the newest kept"
        );
    }

    #[test]
    fn sinks_advancing_at_once_keep_their_own_cursors() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, _) = Spool::open(dir.path(), 1 << 20, false, 2).unwrap();
        for i in 0..300 {
            spool.append(&line(i)).unwrap();
        }
        spool.sync().unwrap();
        let sinks: Vec<_> = (0..2)
            .map(|sink| {
                let spool = spool.clone();
                std::thread::spawn(move || {
                    for i in 0..300 {
                        let (lines, at) = spool.read(sink, 1, Duration::ZERO).unwrap();
                        assert_eq!(ids(&lines), [format!("r{i}")]);
                        spool.advance(sink, at).unwrap();
                    }
                })
            })
            .collect();
        for sink in sinks {
            sink.join().unwrap();
        }
        drop(spool);
        let (spool, _) = Spool::open(dir.path(), 1 << 20, false, 2).unwrap();
        for sink in 0..2 {
            let (left, _) = spool.read(sink, 10, Duration::ZERO).unwrap();
            assert!(left.is_empty(), "sink {sink} resumes after its last record");
        }
    }

    #[test]
    fn files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("spool");
        let (spool, _) = Spool::open(&at, 1 << 20, false, 1).unwrap();
        spool.append(&line(0)).unwrap();
        spool.sync().unwrap();
        let (_, pos) = spool.read(0, 1, Duration::ZERO).unwrap();
        spool.advance(0, pos).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&at), 0o700);
        assert_eq!(mode(&segment_path(&at, 1)), 0o600);
        assert_eq!(mode(&cursor_path(&at, 0)), 0o600);
    }
}
