//! The agent's data directories: created when missing, one agent per
//! directory.
//!
//! Two agents on the same SQLite files would both take the leases of their
//! (same) agent id, take over each other's MQTT client ids and drive the
//! counters negative. Before any store is opened, the agent creates every
//! directory that holds one of its SQLite stores when it is missing
//! ([`sqlite_dirs`], [`create`]), then takes an exclusive lock on
//! `<dir>/ferry-agent.lock` in each (each directory once) and writes its
//! agent id, pid and start time into the file.
//!
//! Invariants:
//! - a directory is created here or nowhere: before its lock, which lives in
//!   it, with mode 0700 for it and every parent created
//!   ([`ferry_shared::os::create_private_dir`]); an existing directory keeps
//!   its mode; one that cannot be created fails before any store or
//!   connection is opened, with an error naming it and the OS's reason;
//! - the locks are held for the life of the process ([`DataDirLocks`] is kept
//!   until `run` returns) and released by the OS when it ends, also on
//!   SIGKILL: a crash never leaves a directory locked;
//! - a second agent fails before it opens any store or connection, with an
//!   error naming the directory and the holder written in the lock file.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use ferry_shared::config::{DlqStoreConfig, LeaseStoreConfig, OutboxStoreConfig, ValidConfig};
use ferry_shared::os;

/// The lock file's name inside a data directory.
pub const LOCK_FILE: &str = "ferry-agent.lock";

/// Why the data directories could not be created or locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The directory is missing and could not be created (no permission, a
    /// file in the way).
    #[error(transparent)]
    Create(#[from] os::CreateDirError),
    /// Another process holds the lock.
    #[error("data directory {dir} is in use by another agent ({holder}); stop it first")]
    Held {
        /// The directory.
        dir: PathBuf,
        /// What the holder wrote into the lock file.
        holder: String,
    },
    /// The lock file could not be opened, locked or written.
    #[error("data directory {dir}: cannot lock {file}: {}", os::reason(error))]
    Io {
        /// The directory.
        dir: PathBuf,
        /// The lock file.
        file: String,
        /// The I/O error (in the message, so not a `source`).
        error: std::io::Error,
    },
}

/// The locks held; dropping it releases them.
#[derive(Debug)]
pub struct DataDirLocks {
    held: Vec<(PathBuf, File)>,
}

impl DataDirLocks {
    /// The directories locked.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.held.iter().map(|(dir, _)| dir.as_path())
    }
}

/// The directories of the configuration's SQLite stores, each once, created
/// when missing (canonical paths, so `./data` and `data` are one directory).
pub fn sqlite_dirs(valid: &ValidConfig) -> Result<Vec<PathBuf>, LockError> {
    let mut paths: Vec<&str> = Vec::new();
    if let Some(OutboxStoreConfig::Sqlite(o)) = &valid.stores.outbox {
        paths.push(&o.path);
    }
    if let Some(LeaseStoreConfig::Sqlite(o)) = &valid.stores.lease {
        paths.push(&o.path);
    }
    if let Some(DlqStoreConfig::Sqlite(o)) = &valid.stores.dlq {
        paths.push(&o.path);
    }
    let mut dirs = paths
        .into_iter()
        .map(|p| {
            let parent = Path::new(p).parent().unwrap_or(Path::new("."));
            if parent.as_os_str().is_empty() {
                create(Path::new("."))
            } else {
                create(parent)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    dirs.sort();
    dirs.dedup();
    Ok(dirs)
}

/// Creates `dir` when it is missing (mode 0700, parents too) and returns its
/// canonical path.
pub fn create(dir: &Path) -> Result<PathBuf, LockError> {
    os::create_private_dir(dir)?;
    dir.canonicalize().map_err(|error| {
        LockError::Create(os::CreateDirError {
            dir: dir.to_owned(),
            error,
        })
    })
}

/// Locks every directory in `dirs` for `agent_id`, or fails on the first
/// one held by another process (releasing those already taken).
pub fn lock(dirs: &[PathBuf], agent_id: &str) -> Result<DataDirLocks, LockError> {
    let mut held = Vec::with_capacity(dirs.len());
    for dir in dirs {
        let file = lock_one(dir, agent_id)?;
        held.push((dir.clone(), file));
    }
    Ok(DataDirLocks { held })
}

fn lock_one(dir: &Path, agent_id: &str) -> Result<File, LockError> {
    let path = dir.join(LOCK_FILE);
    let io = |error| LockError::Io {
        dir: dir.to_owned(),
        file: path.display().to_string(),
        error,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            // The lock is advisory: the holder's line can be read.
            let holder = match file.read_to_string(&mut holder) {
                Ok(_) if !holder.trim().is_empty() => holder.trim().to_owned(),
                _ => "holder unknown".to_owned(),
            };
            return Err(LockError::Held {
                dir: dir.to_owned(),
                holder,
            });
        }
        Err(TryLockError::Error(e)) => return Err(io(e)),
    }
    let started = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let line = format!(
        "agent {agent_id} pid {} started {started} (unix seconds)\n",
        std::process::id()
    );
    file.set_len(0).map_err(io)?;
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    file.write_all(line.as_bytes()).map_err(io)?;
    file.flush().map_err(io)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_directory_names_the_holder_and_a_release_frees_it() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let dirs = vec![dir.path().canonicalize().expect("canonical")];
        let first = lock(&dirs, "first").expect("first lock");
        assert_eq!(first.dirs().count(), 1);
        match lock(&dirs, "second") {
            Err(LockError::Held { holder, .. }) => {
                assert!(holder.contains("agent first"), "{holder}");
                assert!(
                    holder.contains(&format!("pid {}", std::process::id())),
                    "{holder}"
                );
            }
            other => panic!("expected Held, got {other:?}"),
        }
        drop(first);
        let again = lock(&dirs, "second").expect("free after release");
        drop(again);
    }

    #[test]
    fn missing_directories_are_created_private_and_a_file_in_the_way_is_named() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().expect("temporary directory");
        let missing = root.path().join("data/agent");
        let created = create(&missing).expect("created");
        assert_eq!(created, missing.canonicalize().expect("canonical"));
        let mode = std::fs::metadata(&created)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        lock(&[created], "agent").expect("lockable");

        let file = root.path().join("file");
        std::fs::write(&file, b"x").expect("file");
        let err = create(&file.join("data")).expect_err("a file in the way");
        assert_eq!(
            err.to_string(),
            format!(
                "cannot create the data directory {}: not a directory",
                file.join("data").display()
            )
        );
    }
}
