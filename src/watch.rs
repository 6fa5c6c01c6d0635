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

/// Starts watching the files of the policy `reloader` loads.
pub fn spawn(reloader: Arc<Reloader>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("tollgate watch".into())
        .spawn(move || run(&reloader))?;
    Ok(())
}

fn run(reloader: &Reloader) {
    let (tx, events) = channel();
    let mut watch = Watch::new(tx);
    let mut files = config::files_of(reloader.path());
    let mut seen = digests(&files);
    watch.arm(&files);
    tracing::info!(files = ?files, polling = watch.polling, "reloading the policy when its files change");
    loop {
        match events.recv_timeout(RECHECK) {
            Ok(event) => {
                watch.note(&event);
                if !watch.relevant(&event) {
                    continue;
                }
                if !settle(&events, &mut watch) {
                    return;
                }
                watch.arm(&files);
            }
            // A directory replaced meanwhile may hold new files.
            Err(RecvTimeoutError::Timeout) if watch.arm(&files) => {}
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let now = digests(&files);
        if now == seen {
            continue;
        }
        // Counted and logged by the reload when the files are not valid.
        let _ = reloader.reload();
        let named = config::files_of(reloader.path());
        if named != files {
            files = named;
            seen = digests(&files);
            watch.arm(&files);
        } else {
            seen = now;
        }
    }
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
    fn new(tx: Sender<Event>) -> Self {
        match RecommendedWatcher::new(forward(tx.clone()), Config::default()) {
            Ok(watcher) => Self {
                watcher: Box::new(watcher),
                polling: false,
                tx,
                armed: HashMap::new(),
            },
            Err(e) => Self::polling(tx, &e),
        }
    }

    fn polling(tx: Sender<Event>, why: &notify::Error) -> Self {
        tracing::warn!(error = %why, "cannot watch files with the kernel's notifications; polling them instead");
        let config = Config::default()
            .with_poll_interval(RECHECK)
            .with_compare_contents(true);
        let watcher = PollWatcher::new(forward(tx.clone()), config)
            .expect("a poll watcher needs no resource that can be missing");
        Self {
            watcher: Box::new(watcher),
            polling: true,
            tx,
            armed: HashMap::new(),
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
                    *self = Self::polling(self.tx.clone(), &e);
                    self.arm(files);
                    return true;
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
        let watch = Watch::new(tx);
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
