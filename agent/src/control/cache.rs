//! The configuration cache: every ACKed configuration, one file per bridge in
//! `<data-dir>/configs/<bridge-id>.yaml`, so that an agent that cannot reach
//! the control plane at start runs what it last ran.
//!
//! Invariants:
//! - a file is replaced atomically (written to a temporary file beside it,
//!   fsynced, renamed over the old one, directory fsynced): a crash leaves
//!   the old version or the new one, never a torn file;
//! - the file is the document exactly as pushed (variables unexpanded, so it
//!   is expanded from the agent's environment when it runs, as a push is),
//!   after one header line `# ferry-agent cache: version N`, a YAML comment;
//! - a withdrawn bridge's file is removed.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The header line's prefix; the version follows.
const HEADER: &str = "# ferry-agent cache: version ";
/// Suffix of the temporary file written before a rename.
const TMP_SUFFIX: &str = ".tmp";

/// A cached configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached {
    /// Its version, as pushed by the control plane.
    pub version: u64,
    /// The document as pushed.
    pub yaml: String,
}

/// Why the cache could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A file or the directory could not be read, written or synced.
    #[error("configuration cache {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not one this cache wrote.
    #[error("configuration cache {path}: {why}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

/// The cache directory.
#[derive(Clone, Debug)]
pub struct ConfigCache {
    dir: PathBuf,
}

impl ConfigCache {
    /// The cache in `<data_dir>/configs`, created when missing (mode 0700).
    pub fn open(data_dir: &Path) -> Result<Self, CacheError> {
        let dir = data_dir.join("configs");
        ferry_shared::os::create_private_dir(&dir).map_err(|e| CacheError::Io {
            path: dir.clone(),
            source: e.error,
        })?;
        Ok(Self { dir })
    }

    fn path(&self, bridge: &str) -> PathBuf {
        self.dir.join(format!("{bridge}.yaml"))
    }

    /// Replaces `bridge`'s cached configuration atomically.
    pub fn store(&self, bridge: &str, cached: &Cached) -> Result<(), CacheError> {
        let path = self.path(bridge);
        let tmp = self.dir.join(format!("{bridge}.yaml{TMP_SUFFIX}"));
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| CacheError::Io { path, source }
        };
        let mut file = File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(format!("{HEADER}{}\n", cached.version).as_bytes())
            .and_then(|()| file.write_all(cached.yaml.as_bytes()))
            .and_then(|()| file.sync_all())
            .map_err(io(&tmp))?;
        drop(file);
        fs::rename(&tmp, &path).map_err(io(&path))?;
        self.sync_dir()
    }

    /// Forgets `bridge` (nothing to do when it is not cached).
    pub fn remove(&self, bridge: &str) -> Result<(), CacheError> {
        let path = self.path(bridge);
        match fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(CacheError::Io { path, source }),
        }
    }

    /// Every cached configuration by bridge id, and a problem per file that
    /// could not be read (the others are still returned).
    pub fn load(&self) -> Result<(BTreeMap<String, Cached>, Vec<CacheError>), CacheError> {
        let entries = fs::read_dir(&self.dir).map_err(|source| CacheError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let mut cached = BTreeMap::new();
        let mut problems = Vec::new();
        for entry in entries {
            let path = match entry {
                Ok(entry) => entry.path(),
                Err(source) => {
                    problems.push(CacheError::Io {
                        path: self.dir.clone(),
                        source,
                    });
                    continue;
                }
            };
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            // Leftovers of an interrupted store are ignored (and replaced by
            // the next one).
            let Some(bridge) = name.strip_suffix(".yaml") else {
                continue;
            };
            match read(&path) {
                Ok(c) => {
                    cached.insert(bridge.to_owned(), c);
                }
                Err(e) => problems.push(e),
            }
        }
        Ok((cached, problems))
    }

    fn sync_dir(&self) -> Result<(), CacheError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| CacheError::Io {
                path: self.dir.clone(),
                source,
            })
    }
}

fn read(path: &Path) -> Result<Cached, CacheError> {
    let text = fs::read_to_string(path).map_err(|source| CacheError::Io {
        path: path.to_owned(),
        source,
    })?;
    let malformed = |why: &str| CacheError::Malformed {
        path: path.to_owned(),
        why: why.to_owned(),
    };
    let (header, yaml) = text
        .split_once('\n')
        .ok_or_else(|| malformed("no header line"))?;
    let version = header
        .strip_prefix(HEADER)
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|v| *v > 0)
        .ok_or_else(|| malformed("the header line does not carry a version"))?;
    Ok(Cached {
        version,
        yaml: yaml.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_replaces_loads_and_removes() -> Result<(), CacheError> {
        let dir = tempfile::tempdir().map_err(|source| CacheError::Io {
            path: PathBuf::new(),
            source,
        })?;
        let cache = ConfigCache::open(&dir.path().join("missing"))?;
        let v1 = Cached {
            version: 1,
            yaml: "bridge:\n  id: a\n".to_owned(),
        };
        let v2 = Cached {
            version: 2,
            yaml: "bridge:\n  id: a # two\n".to_owned(),
        };
        cache.store("a", &v1)?;
        cache.store("a", &v2)?;
        cache.store("b", &v1)?;
        let (all, problems) = cache.load()?;
        assert!(problems.is_empty());
        assert_eq!(all.get("a"), Some(&v2));
        assert_eq!(all.get("b"), Some(&v1));
        cache.remove("b")?;
        cache.remove("b")?;
        let (all, _) = cache.load()?;
        assert_eq!(all.keys().collect::<Vec<_>>(), vec!["a"]);
        Ok(())
    }

    #[test]
    fn a_file_without_header_is_reported_and_skipped() -> Result<(), CacheError> {
        let dir = tempfile::tempdir().map_err(|source| CacheError::Io {
            path: PathBuf::new(),
            source,
        })?;
        let cache = ConfigCache::open(dir.path())?;
        let io = |source| CacheError::Io {
            path: PathBuf::new(),
            source,
        };
        fs::write(dir.path().join("configs/x.yaml"), "bridge: {}\n").map_err(io)?;
        fs::write(dir.path().join("configs/y.yaml.tmp"), "torn").map_err(io)?;
        let (all, problems) = cache.load()?;
        assert!(all.is_empty());
        assert_eq!(problems.len(), 1);
        Ok(())
    }
}
