//! What the binaries ask of the operating system as they start, and how they say in one line
//! that it refused: a private data directory created when missing ([`CreateDirError`]), a
//! listener that cannot bind ([`ListenError`]), a file that cannot be read ([`reason`]).
//!
//! Both halves create their data directories with [`create_private_dir`]: mode 0700 for every
//! directory Ferry creates (parents too), because they hold messages and their ids; a directory
//! that exists is left as it is (never chmod-ed).

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// The mode of every directory Ferry creates: owner only.
pub const PRIVATE_DIR_MODE: u32 = 0o700;

/// Creates `dir` and its missing parents with mode [`PRIVATE_DIR_MODE`] (minus the umask);
/// an existing directory is left untouched.
pub fn create_private_dir(dir: &Path) -> Result<(), CreateDirError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR_MODE)
        .create(dir)
        .map_err(|error| CreateDirError {
            dir: dir.to_owned(),
            error,
        })
}

/// A data directory that could not be created (no permission, a file in the way):
/// `cannot create the data directory /x/data: not a directory`.
#[derive(Debug)]
pub struct CreateDirError {
    /// The directory asked for.
    pub dir: PathBuf,
    /// The OS's error (in the message, so not a `source`).
    pub error: io::Error,
}

impl fmt::Display for CreateDirError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot create the data directory {}: {}",
            self.dir.display(),
            reason(&self.error)
        )
    }
}

impl std::error::Error for CreateDirError {}

/// The operating system's reason, as a message fragment: lowercase, without the
/// `(os error N)` suffix (`no such file or directory`, `permission denied`).
pub fn reason(error: &io::Error) -> String {
    let text = error.to_string();
    let text = match error.raw_os_error() {
        Some(code) => text
            .strip_suffix(&format!(" (os error {code})"))
            .unwrap_or(&text)
            .to_owned(),
        None => text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

/// A listener that could not be bound, with what it is for and the flag that chooses its
/// address: `cannot listen on 127.0.0.1:9464 (admin listener): address already in use, another
/// process holds it; choose another --admin-listen`.
#[derive(Debug)]
pub struct ListenError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// What listens there, e.g. `admin listener`.
    pub what: &'static str,
    /// The flag that sets the address, e.g. `--admin-listen`.
    pub flag: &'static str,
    /// The bind error (in the message, so not a `source`).
    pub error: io::Error,
}

impl fmt::Display for ListenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            addr, what, flag, ..
        } = self;
        write!(f, "cannot listen on {addr} ({what}): ")?;
        match self.error.kind() {
            io::ErrorKind::AddrInUse => write!(
                f,
                "address already in use, another process holds it; choose another {flag}"
            ),
            io::ErrorKind::AddrNotAvailable => write!(
                f,
                "address not available, no interface of this host has it; choose another {flag}"
            ),
            io::ErrorKind::PermissionDenied => write!(
                f,
                "permission denied (ports below 1024 need privileges); choose another {flag}"
            ),
            _ => write!(f, "{}; check {flag}", reason(&self.error)),
        }
    }
}

impl std::error::Error for ListenError {}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).map_or(0, |m| m.permissions().mode() & 0o777)
    }

    #[test]
    fn creates_missing_directories_private_and_leaves_existing_ones_alone() {
        let root = tempfile::tempdir().expect("temporary directory");
        let existing = root.path().join("existing");
        std::fs::create_dir(&existing).expect("existing");
        std::fs::set_permissions(&existing, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let deep = existing.join("a/b");
        create_private_dir(&deep).expect("created");
        assert_eq!(mode(&existing.join("a")), 0o700);
        assert_eq!(mode(&deep), 0o700);
        assert_eq!(
            mode(&existing),
            0o755,
            "an existing directory is not chmod-ed"
        );
        create_private_dir(&deep).expect("existing is fine");
    }

    #[test]
    fn a_file_in_the_way_is_an_error() {
        let root = tempfile::tempdir().expect("temporary directory");
        let file = root.path().join("file");
        std::fs::write(&file, b"x").expect("file");
        let err = create_private_dir(&file.join("sub")).expect_err("a file is in the way");
        assert_eq!(
            err.to_string(),
            format!(
                "cannot create the data directory {}: not a directory",
                file.join("sub").display()
            )
        );
    }

    #[test]
    fn reasons_are_lowercase_without_the_os_error_code() {
        let err = std::fs::read("/nonexistent/ferry.yaml").expect_err("missing");
        assert_eq!(reason(&err), "no such file or directory");
        let custom = io::Error::other("Custom text");
        assert_eq!(reason(&custom), "custom text");
    }

    #[test]
    fn a_port_in_use_names_the_listener_and_the_flag() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("address");
        let error = std::net::TcpListener::bind(addr).expect_err("in use");
        let err = ListenError {
            addr,
            what: "admin listener",
            flag: "--admin-listen",
            error,
        };
        assert_eq!(
            err.to_string(),
            format!(
                "cannot listen on {addr} (admin listener): address already in use, another process holds it; choose another --admin-listen"
            )
        );
    }
}
