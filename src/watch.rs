//! Reload on change (`server.watch`): the directories of the policy's files
//! (the policy, its keys file, TLS certificate and key, JWKS files) are
//! watched from a thread of their own, and when a file's content changed
//! the policy is reloaded through the path SIGHUP takes, so a broken file
//! keeps the last good policy and is counted the same way.
//!
//! Directories, not files: Kubernetes mounts a ConfigMap as links through
//! `..data` to a timestamped directory that it replaces by renaming a new
//! link over `..data` and then deletes; a watch on the file would follow
//! the link into the deleted directory and hear nothing more. A directory
//! that is itself replaced or removed is watched again once it is back.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
use notify::{Config, Event, PollWatcher, RecommendedWatcher, RecursiveMode, Watcher};
use sha2::{Digest, Sha256};

use crate::config;
use crate::reload::Reloader;

/// Quiet time after the last event before the files are read: an editor's
/// write, rename and chmod make one reload.
const SETTLE: Duration = Duration::from_millis(150);
/// Events arriving without a pause are read at most this long (a busy log
/// in the same directory cannot hold a reload back).
const SETTLE_AT_MOST: Duration = Duration::from_secs(1);
/// How often directories that went away are looked for again, and how
/// often the poller reads the files where inotify is unavailable.
const RECHECK: Duration = Duration::from_millis(500);

/// Each file's SHA-256, `None` when it cannot be read.
type Digests = Vec<(PathBuf, Option<[u8; 32]>)>;

/// The files of the policy at `path` as they are now: taken before the
/// policy is loaded, so that a change made while the gateway starts is
/// reloaded too.
pub struct Baseline(Digests);

/// What the files of the policy at `path` hold now.
pub fn baseline(path: &Path) -> Baseline {
    Baseline(digests(&config::files_of(path)))
}

/// Starts watching the files of the policy `reloader` loads, which held
/// `since` when it was loaded.
pub fn spawn(reloader: Arc<Reloader>, since: Baseline) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("tollgate watch".into())
        .spawn(move || run(&reloader, since.0))?;
    Ok(())
}

fn run(reloader: &Reloader, mut seen: Digests) {
    let (tx, events) = channel();
    let Some(mut watch) = Watch::new(tx) else {
        return;
    };
    let mut files = config::files_of(reloader.path());
    watch.arm(&files);
    tracing::info!(files = ?files, polling = watch.polling, "reloading the policy when its files change");
    let mut stamped = stamps(&files);
    let mut tick = crate::clock::instant() + RECHECK;
    // Read once at once: the files may have changed since the baseline.
    let mut read_now = true;
    loop {
        if !std::mem::take(&mut read_now) {
            match changed(&events, &mut watch, &files, &stamped, &mut tick) {
                Some(true) => {}
                Some(false) => continue,
                None => return,
            }
        }
        stamped = stamps(&files);
        let now = digests(&files);
        if now == seen {
            continue;
        }
        // Counted and logged by the reload when the files are not valid.
        let _ = reloader.reload();
        let named = config::files_of(reloader.path());
        if named != files {
            files = named;
            watch.arm(&files);
            stamped = stamps(&files);
            seen = digests(&files);
        } else {
            seen = now;
        }
    }
}

/// Waits for a sign that a file may have changed: an event that can mean
/// it (once the directory is quiet), a directory watched again, or, at
/// each periodic check, a file whose inode, size or time differ from
/// `stamped` (a change its directory's watch cannot hear: a write through
/// another link or mount of the file, as a single-file bind mount is).
/// `None` when the watcher is gone.
fn changed(
    events: &Receiver<Event>,
    watch: &mut Watch,
    files: &[PathBuf],
    stamped: &Stamps,
    tick: &mut std::time::Instant,
) -> Option<bool> {
    match events.recv_timeout(RECHECK) {
        Ok(event) => {
            watch.note(&event);
            if watch.relevant(&event) {
                if !settle(events, watch) {
                    return None;
                }
                watch.arm(files);
                return Some(true);
            }
            if crate::clock::instant() < *tick {
                return Some(false);
            }
        }
        Err(RecvTimeoutError::Timeout) => {}
        Err(RecvTimeoutError::Disconnected) => return None,
    }
    *tick = crate::clock::instant() + RECHECK;
    let rearmed = watch.arm(files);
    Some(rearmed || stamps(files) != *stamped)
}

/// Each file's device, inode, size and modification time, as `stat`
/// reads them through links.
type Stamps = Vec<Option<(u64, u64, u64, i64, i64)>>;

fn stamps(files: &[PathBuf]) -> Stamps {
    files
        .iter()
        .map(|f| {
            let m = std::fs::metadata(f).ok()?;
            Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
        })
        .collect()
}

/// Waits until events pause; false when the watcher is gone.
fn settle(events: &Receiver<Event>, watch: &mut Watch) -> bool {
    let deadline = crate::clock::instant() + SETTLE_AT_MOST;
    while crate::clock::instant() < deadline {
        match events.recv_timeout(SETTLE) {
            Ok(event) => watch.note(&event),
            Err(RecvTimeoutError::Timeout) => return true,
            Err(RecvTimeoutError::Disconnected) => return false,
        }
    }
    true
}

fn digests(files: &[PathBuf]) -> Digests {
    files
        .iter()
        .map(|f| {
            let digest = std::fs::read(f).ok().map(|b| Sha256::digest(b).into());
            (f.clone(), digest)
        })
        .collect()
}

/// The directories watched, by inotify or else by polling.
struct Watch {
    watcher: Box<dyn Watcher + Send>,
    polling: bool,
    tx: Sender<Event>,
    /// Each directory armed, with the identity (device, inode) it had then.
    armed: HashMap<PathBuf, Option<(u64, u64)>>,
}

impl Watch {
    /// The kernel's notifications, or else a poller; `None` (logged) when
    /// neither can be had.
    fn new(tx: Sender<Event>) -> Option<Self> {
        match RecommendedWatcher::new(forward(tx.clone()), Config::default()) {
            Ok(watcher) => Some(Self {
                watcher: Box::new(watcher),
                polling: false,
                tx,
                armed: HashMap::new(),
            }),
            Err(e) => Self::polling(tx, &e),
        }
    }

    fn polling(tx: Sender<Event>, why: &notify::Error) -> Option<Self> {
        tracing::warn!(error = %why, "cannot watch files with the kernel's notifications; polling them instead");
        let config = Config::default()
            .with_poll_interval(RECHECK)
            .with_compare_contents(true);
        match PollWatcher::new(forward(tx.clone()), config) {
            Ok(watcher) => Some(Self {
                watcher: Box::new(watcher),
                polling: true,
                tx,
                armed: HashMap::new(),
            }),
            Err(e) => {
                tracing::error!(error = %e, "cannot watch the policy's files; reload with SIGHUP");
                None
            }
        }
    }

    /// Forgets the watch of a directory that was removed or moved away
    /// (the kernel dropped it), so that the next [`Watch::arm`] watches
    /// what stands at its path then, even should it have the same inode.
    fn note(&mut self, event: &Event) {
        if matches!(
            event.kind,
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
        ) {
            for path in &event.paths {
                if let Some(armed) = self.armed.get_mut(path) {
                    *armed = None;
                }
            }
        }
    }

    /// Whether an event can mean a file's content changed: a write that
    /// closed, a rename, a creation or removal. Writes still open are not
    /// (the close that ends them is), nor are reads.
    fn relevant(&self, event: &Event) -> bool {
        match event.kind {
            _ if self.polling => true,
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
            EventKind::Access(_) | EventKind::Modify(ModifyKind::Data(_)) => false,
            _ => true,
        }
    }

    /// Watches the directory of each file, again where the directory was
    /// replaced or came back since; true when any was (re-)armed.
    fn arm(&mut self, files: &[PathBuf]) -> bool {
        let mut dirs: Vec<PathBuf> = files.iter().map(|f| directory_of(f)).collect();
        dirs.sort();
        dirs.dedup();
        let mut changed = false;
        self.armed.retain(|dir, _| dirs.contains(dir));
        for dir in dirs {
            let now = std::fs::metadata(&dir).ok().map(|m| (m.dev(), m.ino()));
            let Some(identity) = now else { continue };
            if self.armed.get(&dir) == Some(&Some(identity)) {
                continue;
            }
            let _ = self.watcher.unwatch(&dir);
            match self.watcher.watch(&dir, RecursiveMode::NonRecursive) {
                Ok(()) => {
                    self.armed.insert(dir, Some(identity));
                    changed = true;
                }
                Err(e) if !self.polling && !matches!(e.kind, notify::ErrorKind::PathNotFound) => {
                    // Out of inotify watches or instances: poll everything.
                    if let Some(polling) = Self::polling(self.tx.clone(), &e) {
                        *self = polling;
                        self.arm(files);
                        return true;
                    }
                    self.armed.insert(dir, None);
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot watch a policy file's directory; trying again");
                    self.armed.insert(dir, None);
                }
            }
        }
        changed
    }
}

/// The directory a file is watched through (its own, `.` for a bare name).
fn directory_of(file: &Path) -> PathBuf {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The watcher's handler: events into the channel; an error (a queue
/// overflow) as an event of unknown kind, so the files are read again.
fn forward(tx: Sender<Event>) -> impl Fn(notify::Result<Event>) + Send + 'static {
    move |result| {
        let event = result.unwrap_or_else(|_| Event::new(EventKind::Other));
        let _ = tx.send(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{CreateKind, DataChange, RenameMode};

    #[test]
    fn writes_count_when_closed_and_reads_never() {
        let (tx, _rx) = channel();
        let watch = Watch::new(tx).expect("a watcher");
        let kinds = [
            (
                EventKind::Access(AccessKind::Close(AccessMode::Write)),
                true,
            ),
            (EventKind::Modify(ModifyKind::Name(RenameMode::Both)), true),
            (EventKind::Create(CreateKind::File), true),
            (EventKind::Modify(ModifyKind::Data(DataChange::Any)), false),
            (EventKind::Access(AccessKind::Open(AccessMode::Read)), false),
        ];
        for (kind, relevant) in kinds {
            assert_eq!(
                watch.relevant(&Event::new(kind)),
                relevant || watch.polling,
                "{kind:?}"
            );
        }
    }

    #[test]
    fn a_bare_file_name_is_watched_through_the_working_directory() {
        assert_eq!(directory_of(Path::new("p.yaml")), PathBuf::from("."));
        assert_eq!(
            directory_of(Path::new("/etc/tollgate/p.yaml")),
            PathBuf::from("/etc/tollgate")
        );
    }
}
