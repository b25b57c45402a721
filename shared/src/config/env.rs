//! `${VAR}` / `${VAR:-default}` expansion on the raw configuration text, before it is parsed.
//!
//! - `${NAME}` is replaced by the variable's value; an unset variable is an error naming it and
//!   its line.
//! - `${NAME:-default}` is replaced by the value, or by `default` when the variable is unset or
//!   empty (the shell's `:-`). The default runs to the first `}` and is not expanded itself.
//! - `$$` is a literal `$`. A `$` followed by anything other than `{` or `$` is kept as is, so
//!   MQTT topics such as `$share/group/sensors/#` need no escaping.
//!
//! Expansion is textual: it also applies inside YAML comments, and a value containing YAML syntax
//! (`: `, a newline, a leading `*`) should be quoted in the document (`password: "${PASSWORD}"`).

/// Where variables come from. Any `Fn(&str) -> Option<String>` is one, so tests pass a closure
/// over a map instead of touching the process environment.
pub trait Env {
    /// The value of `name`, or `None` when it is unset.
    fn var(&self, name: &str) -> Option<String>;
}

impl<F: Fn(&str) -> Option<String>> Env for F {
    fn var(&self, name: &str) -> Option<String> {
        self(name)
    }
}

/// The process environment. A value that is not valid Unicode counts as unset.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// Why the text could not be expanded. Lines and columns count from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// `${NAME}` without a default, and `NAME` is not set.
    #[error(
        "line {line}: environment variable {name} is not set (and `${{{name}}}` has no `:-default`)"
    )]
    Unset {
        /// The variable.
        name: String,
        /// Its line in the document.
        line: usize,
    },
    /// `${` without a closing `}` on the same line.
    #[error(
        "line {line} column {column}: `${{` is not closed by `}}` on the same line (write `$$` for a literal `$`)"
    )]
    Unterminated {
        /// The line of the `${`.
        line: usize,
        /// The column of the `$`.
        column: usize,
    },
    /// `${...}` whose name is not `[A-Za-z_][A-Za-z0-9_]*`.
    #[error(
        "line {line}: `${{{name}}}` is not a valid variable name (letters, digits and `_`, not starting with a digit)"
    )]
    InvalidName {
        /// What stood between the braces (before any `:-`).
        name: String,
        /// Its line in the document.
        line: usize,
    },
}

/// Expands `${VAR}`, `${VAR:-default}` and `$$` in `text` using `env`.
pub fn expand(text: &str, env: &dyn Env) -> Result<String, EnvError> {
    let mut out = String::with_capacity(text.len());
    for (index, line) in text.split_inclusive('\n').enumerate() {
        expand_line(line, index + 1, env, &mut out)?;
    }
    Ok(out)
}

fn expand_line(
    line: &str,
    line_no: usize,
    env: &dyn Env,
    out: &mut String,
) -> Result<(), EnvError> {
    let mut rest = line;
    while let Some(dollar) = rest.find('$') {
        out.push_str(&rest[..dollar]);
        let after = &rest[dollar + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner_and_tail) = after.strip_prefix('{') {
            let Some(close) = inner_and_tail
                .find(['}', '\n'])
                .filter(|&i| inner_and_tail[i..].starts_with('}'))
            else {
                let column = line.len() - rest.len() + dollar;
                return Err(EnvError::Unterminated {
                    line: line_no,
                    column: line[..column].chars().count() + 1,
                });
            };
            let inner = &inner_and_tail[..close];
            let (name, default) = match inner.split_once(":-") {
                Some((name, default)) => (name, Some(default)),
                None => (inner, None),
            };
            if !is_valid_name(name) {
                return Err(EnvError::InvalidName {
                    name: name.to_owned(),
                    line: line_no,
                });
            }
            match (env.var(name), default) {
                (Some(value), Some(default)) if value.is_empty() => out.push_str(default),
                (Some(value), _) => out.push_str(&value),
                (None, Some(default)) => out.push_str(default),
                (None, None) => {
                    return Err(EnvError::Unset {
                        name: name.to_owned(),
                        line: line_no,
                    });
                }
            }
            rest = &inner_and_tail[close + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(())
}

fn is_valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOST" => Some("mqtt.example.com".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    fn x(text: &str) -> Result<String, EnvError> {
        expand(text, &env)
    }

    #[test]
    fn substitutes_set_variables_and_defaults() {
        assert_eq!(
            x("url: tcp://${HOST}:1883").as_deref(),
            Ok("url: tcp://mqtt.example.com:1883")
        );
        assert_eq!(x("a: ${MISSING:-fallback}").as_deref(), Ok("a: fallback"));
        assert_eq!(
            x("a: ${HOST:-fallback}").as_deref(),
            Ok("a: mqtt.example.com")
        );
        assert_eq!(x("a: ${EMPTY:-fallback}").as_deref(), Ok("a: fallback"));
        assert_eq!(x("a: '${EMPTY}'").as_deref(), Ok("a: ''"));
        assert_eq!(x("a: ${MISSING:-}").as_deref(), Ok("a: "));
        assert_eq!(x("a: ${MISSING:-x:-y}").as_deref(), Ok("a: x:-y"));
    }

    #[test]
    fn dollar_escapes_and_lone_dollars() {
        assert_eq!(x("a: $${HOST}").as_deref(), Ok("a: ${HOST}"));
        assert_eq!(x("a: $$").as_deref(), Ok("a: $"));
        assert_eq!(
            x("topic: $share/g/sensors/#").as_deref(),
            Ok("topic: $share/g/sensors/#")
        );
        assert_eq!(x("a: cost $5 $").as_deref(), Ok("a: cost $5 $"));
        assert_eq!(x("é: ${HOST}é").as_deref(), Ok("é: mqtt.example.comé"));
    }

    #[test]
    fn unset_variable_names_itself_and_its_line() {
        let err = x("a: 1\nb: 2\nc: ${BROKER_URL}\n").expect_err("unset");
        assert_eq!(
            err,
            EnvError::Unset {
                name: "BROKER_URL".into(),
                line: 3
            }
        );
        let shown = err.to_string();
        assert!(
            shown.contains("BROKER_URL") && shown.contains("line 3"),
            "{shown}"
        );
    }

    #[test]
    fn malformed_references_are_errors() {
        assert_eq!(
            x("a: 1\nb: ${HOST\n}"),
            Err(EnvError::Unterminated { line: 2, column: 4 })
        );
        assert_eq!(
            x("a: ${1BAD}"),
            Err(EnvError::InvalidName {
                name: "1BAD".into(),
                line: 1
            })
        );
        assert_eq!(
            x("a: ${}"),
            Err(EnvError::InvalidName {
                name: String::new(),
                line: 1
            })
        );
    }

    #[test]
    fn keeps_line_structure() {
        let text = "a: ${HOST}\r\nb: 2\n\nc: 3";
        assert_eq!(
            x(text).as_deref(),
            Ok("a: mqtt.example.com\r\nb: 2\n\nc: 3")
        );
    }
}
