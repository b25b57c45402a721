//! Loading a document: size check, UTF-8, `${VAR}` expansion, then YAML → [`BridgeConfig`].
//!
//! Loading only parses; [`super::validate`] checks the meaning. Nothing here touches the process
//! environment except [`load_file`], which reads it through [`ProcessEnv`].

use std::path::{Path, PathBuf};

use super::env::{Env, EnvError, ProcessEnv, expand};
use super::model::BridgeConfig;

/// The largest configuration document accepted, in bytes (before expansion).
pub const MAX_CONFIG_BYTES: usize = 1024 * 1024;

/// Why a document could not be loaded. Nothing was applied in any case.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read (missing, not readable, a directory).
    #[error("cannot read configuration file {}: {}", path.display(), crate::os::reason(source))]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The document is larger than [`MAX_CONFIG_BYTES`] (before or after expansion).
    #[error("configuration is {size} bytes, more than the limit of {limit} bytes")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The document is not UTF-8.
    #[error("configuration is not valid UTF-8 (line {line})")]
    NotUtf8 {
        /// The line of the first invalid byte.
        line: usize,
    },
    /// `${VAR}` expansion failed.
    #[error("environment expansion: {0}")]
    Env(#[from] EnvError),
    /// The YAML does not parse, or does not have the configuration's shape (an unknown key, a
    /// wrong type, a missing required key).
    #[error("yaml error at line {line} column {column}: {message}")]
    Yaml {
        /// Line, counting from 1 (0 when unknown).
        line: u64,
        /// Column, counting from 1 (0 when unknown).
        column: u64,
        /// What is wrong.
        message: String,
    },
}

/// Reads `path`, expands `${VAR}` from the process environment, and parses it.
pub fn load_file(path: &Path) -> Result<BridgeConfig, LoadError> {
    load_file_with_env(path, &ProcessEnv)
}

/// Reads `path`, expands `${VAR}` from `env`, and parses it.
pub fn load_file_with_env(path: &Path, env: &dyn Env) -> Result<BridgeConfig, LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    load_bytes(&bytes, env)
}

/// Checks the size and encoding of `bytes` (as the control plane receives them), expands
/// `${VAR}` from `env`, and parses the result.
pub fn load_bytes(bytes: &[u8], env: &dyn Env) -> Result<BridgeConfig, LoadError> {
    check_size(bytes.len())?;
    let text = std::str::from_utf8(bytes).map_err(|e| LoadError::NotUtf8 {
        line: bytes[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1,
    })?;
    load_str(text, env)
}

/// Expands `${VAR}` in `text` from `env` and parses the result.
pub fn load_str(text: &str, env: &dyn Env) -> Result<BridgeConfig, LoadError> {
    check_size(text.len())?;
    let expanded = expand(text, env)?;
    check_size(expanded.len())?;
    parse(&expanded)
}

/// Parses YAML text that needs no expansion (it is taken literally, `$` included).
pub fn parse(text: &str) -> Result<BridgeConfig, LoadError> {
    serde_saphyr::from_str(text).map_err(|e| yaml_error(&e))
}

fn check_size(size: usize) -> Result<(), LoadError> {
    if size > MAX_CONFIG_BYTES {
        return Err(LoadError::TooLarge {
            size,
            limit: MAX_CONFIG_BYTES,
        });
    }
    Ok(())
}

fn yaml_error(err: &serde_saphyr::Error) -> LoadError {
    let (line, column) = err.location().map_or((0, 0), |l| (l.line(), l.column()));
    let message =
        serde_saphyr::MessageFormatter::format_message(&serde_saphyr::DefaultMessageFormatter, err);
    // The library's wording points at its own multi-document API; say what it means here.
    let message = if message.starts_with("multiple YAML documents") {
        "a configuration file holds exactly one bridge, found a second YAML document".to_owned()
    } else {
        message.into_owned()
    };
    LoadError::Yaml {
        line,
        column,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    const MINIMAL: &str = "bridge:\n  id: b\n";

    #[test]
    fn loads_a_minimal_document() {
        let config = load_str(MINIMAL, &no_env).expect("loads");
        assert_eq!(config.bridge.id, "b");
        assert!(config.routes.is_empty());
    }

    #[test]
    fn syntax_error_names_line_and_column() {
        let err = load_str("bridge:\n  id: b\nsessions: [\n", &no_env).expect_err("syntax");
        let LoadError::Yaml { line, column, .. } = &err else {
            panic!("expected a yaml error, got {err:?}");
        };
        assert!(*line >= 3 && *column >= 1, "{err}");
        assert!(
            err.to_string()
                .contains(&format!("line {line} column {column}"))
        );
    }

    #[test]
    fn unknown_key_is_an_error_with_its_location() {
        let err = load_str("bridge:\n  id: b\n  name: x\n", &no_env).expect_err("unknown key");
        let shown = err.to_string();
        assert!(shown.contains("unknown field `name`"), "{shown}");
        assert!(shown.contains("line 3 column 3"), "{shown}");
    }

    #[test]
    fn unset_variable_is_reported() {
        let err = load_str("bridge:\n  id: ${BRIDGE_ID}\n", &no_env).expect_err("unset");
        assert!(
            matches!(&err, LoadError::Env(EnvError::Unset { name, line: 2 }) if name == "BRIDGE_ID")
        );
        let env = |name: &str| (name == "BRIDGE_ID").then(|| "from-env".to_owned());
        let config = load_str("bridge:\n  id: ${BRIDGE_ID}\n", &env).expect("set");
        assert_eq!(config.bridge.id, "from-env");
    }

    #[test]
    fn oversized_and_non_utf8_documents_are_refused() {
        let big = vec![b'#'; MAX_CONFIG_BYTES + 1];
        assert!(matches!(
            load_bytes(&big, &no_env),
            Err(LoadError::TooLarge { size, limit: MAX_CONFIG_BYTES }) if size == MAX_CONFIG_BYTES + 1
        ));
        let expanding = |_: &str| Some("x".repeat(MAX_CONFIG_BYTES));
        assert!(matches!(
            load_str("bridge:\n  id: ${HUGE}\n", &expanding),
            Err(LoadError::TooLarge { .. })
        ));
        assert!(matches!(
            load_bytes(b"bridge:\n  id: \xff\n", &no_env),
            Err(LoadError::NotUtf8 { line: 2 })
        ));
    }

    #[test]
    fn second_document_is_refused() {
        let err = load_str("bridge:\n  id: a\n---\nbridge:\n  id: b\n", &no_env).expect_err("two");
        assert!(err.to_string().contains("exactly one bridge"), "{err}");
    }

    #[test]
    fn missing_file_is_an_io_error() {
        let err = load_file(Path::new("/nonexistent/ferry.yaml")).expect_err("missing");
        assert!(matches!(err, LoadError::Io { .. }));
        assert_eq!(
            err.to_string(),
            "cannot read configuration file /nonexistent/ferry.yaml: no such file or directory"
        );
        let err = load_file(Path::new("/")).expect_err("a directory");
        assert_eq!(
            err.to_string(),
            "cannot read configuration file /: is a directory"
        );
    }

    proptest::proptest! {
        #[test]
        fn loader_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = load_bytes(&bytes, &no_env);
        }

        /// Splice random text into the reference document: loading and validating whatever
        /// parses must return, never panic.
        #[test]
        fn load_and_validate_never_panic_on_edited_documents(
            at in 0usize..2000,
            cut in 0usize..40,
            insert in "[a-z_:{}\\[\\]$\\-#&*!|>'\" \n0-9.]{0,20}",
        ) {
            let seed = include_str!("testdata/seed_main.yaml");
            let at = at.min(seed.len());
            let end = (at + cut).min(seed.len());
            if seed.is_char_boundary(at) && seed.is_char_boundary(end) {
                let text = format!("{}{insert}{}", &seed[..at], &seed[end..]);
                if let Ok(config) = load_str(&text, &no_env) {
                    let _ = super::super::validate(&config);
                }
            }
        }

        #[test]
        fn loader_never_panics_on_yamlish_text(text in "[a-z_:{}\\[\\]$\\-#&*!|>'\" \n0-9.]{0,300}") {
            let _ = load_str(&text, &no_env);
        }
    }
}
