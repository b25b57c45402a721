//! Secrets in a configuration: the values Ferry never logs or echoes.
//!
//! The secret fields of the document are listed once, in [`SECRET_FIELDS`]
//! (and in `docs/configuration.md`, "Secrets"):
//!
//! - `sessions[].options.session.password` — an MQTT, RabbitMQ or NATS password, whole;
//! - `sessions[].options.session.token` — a NATS token, whole;
//! - `stores.{outbox,lease,dlq}.options.url` — the password inside a
//!   `postgres://user:password@host/db` URL (the rest of the URL is not
//!   secret and stays readable).
//!
//! TLS key material is given as file paths (`client_key_file`), which are not
//! secret; Ferry never reads key contents into the configuration.
//!
//! Two guards keep them out of sight:
//!
//! - in the model, each is a [`Secret`], whose `Debug` and `Display` print
//!   [`MASK`], so a logged configuration, session or error built from them
//!   cannot show one; code that needs the value calls [`Secret::expose`];
//! - a stored document (text) is masked with [`mask_document`] before it is
//!   shown (the control plane does this for every document it returns,
//!   unless an admin asks for it whole).
//!
//! A value that is only a variable reference (`${MQTT_PASSWORD}` or
//! `${MQTT_PASSWORD:-}`) holds no secret (the agent expands it from its own
//! environment) and is shown as written; anything else, including a
//! reference with a non-empty default, is masked.

use std::fmt;

use serde::Deserialize;
use serde_json::Value;

/// What a masked secret reads as.
pub const MASK: &str = "***";

/// A secret string of the configuration. Prints as [`MASK`]; read it with
/// [`Secret::expose`] where it is used (a broker's CONNECT, a database
/// connection), never in a message.
#[derive(Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// The secret itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

/// How much of a secret field is secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// The whole value.
    Whole,
    /// The password of the URL's `user:password@` part.
    UrlPassword,
}

/// Every secret field of the document: its path (`*` is every element of a
/// list or every value of a mapping) and how much of it is secret.
pub const SECRET_FIELDS: &[(&[&str], SecretKind)] = &[
    (
        &["sessions", "*", "options", "session", "password"],
        SecretKind::Whole,
    ),
    (
        &["sessions", "*", "options", "session", "token"],
        SecretKind::Whole,
    ),
    (&["stores", "*", "options", "url"], SecretKind::UrlPassword),
    (&["stores", "*", "options", "dsn"], SecretKind::UrlPassword),
];

/// Replaces every secret of a document (as a generic value) by [`MASK`];
/// true when anything was masked.
pub fn mask_document(document: &mut Value) -> bool {
    let mut masked = false;
    for (path, kind) in SECRET_FIELDS {
        mask_at(document, path, *kind, &mut masked);
    }
    masked
}

fn mask_at(value: &mut Value, path: &[&str], kind: SecretKind, masked: &mut bool) {
    let Some((first, rest)) = path.split_first() else {
        if let Value::String(text) = value
            && let Some(shown) = mask_text(text, kind)
        {
            *text = shown;
            *masked = true;
        } else if !matches!(value, Value::Null | Value::String(_)) {
            // A number or a mapping where a secret string belongs: the
            // validator refuses it, but it still must not be shown.
            *value = Value::String(MASK.to_owned());
            *masked = true;
        }
        return;
    };
    match (value, *first) {
        (Value::Array(items), "*") => {
            for item in items {
                mask_at(item, rest, kind, masked);
            }
        }
        (Value::Object(map), "*") => {
            for item in map.values_mut() {
                mask_at(item, rest, kind, masked);
            }
        }
        (Value::Object(map), key) => {
            if let Some(item) = map.get_mut(key) {
                mask_at(item, rest, kind, masked);
            }
        }
        _ => {}
    }
}

/// The text to show instead of `text`, or `None` when it holds no secret.
fn mask_text(text: &str, kind: SecretKind) -> Option<String> {
    match kind {
        SecretKind::Whole => hides_secret(text).then(|| MASK.to_owned()),
        SecretKind::UrlPassword => {
            let (before, password, after) = url_password(text)?;
            hides_secret(password).then(|| format!("{before}{MASK}{after}"))
        }
    }
}

/// Whether a value holds a secret: anything but empty, the mask itself, or
/// one variable reference without a default.
fn hides_secret(value: &str) -> bool {
    if value.is_empty() || value == MASK {
        return false;
    }
    let Some(name) = value
        .strip_prefix("${")
        .and_then(|v| v.strip_suffix('}'))
        .map(|v| v.strip_suffix(":-").unwrap_or(v))
    else {
        return true;
    };
    name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A URL cut around its password: `scheme://user:` / `password` /
/// `@host...`; `None` when it has none.
fn url_password(url: &str) -> Option<(&str, &str, &str)> {
    let authority_start = url.find("://")? + 3;
    let rest = &url[authority_start..];
    // The userinfo ends at the last `@` of the authority; a password may
    // hold a raw `/` or `?`, so look up to the last `@` at all.
    let at = rest.rfind('@')?;
    let colon = rest[..at].find(':')?;
    let start = authority_start + colon + 1;
    let end = authority_start + at;
    Some((&url[..start], &url[start..end], &url[end..]))
}

/// A URL as messages may show it: the password of a `user:password@` part
/// replaced by [`MASK`] (whatever field the URL was given in).
pub fn mask_url(url: &str) -> String {
    match url_password(url) {
        Some((before, password, after)) if !password.is_empty() => {
            format!("{before}{MASK}{after}")
        }
        _ => url.to_owned(),
    }
}

/// Masks the secrets of a document given as YAML text. The text comes back
/// unchanged when it holds none (comments and layout kept); otherwise it is
/// re-serialized with every secret replaced by [`MASK`] (comments dropped).
/// A document that does not parse is not shown at all.
pub fn mask_yaml(text: &str) -> String {
    let Ok(mut document) = serde_saphyr::from_str::<Value>(text) else {
        return "# the stored document could not be parsed to mask its secrets; \
                ask for it with its secrets revealed (admin)\n"
            .to_owned();
    };
    if !mask_document(&mut document) {
        return text.to_owned();
    }
    serde_saphyr::to_string(&document)
        .unwrap_or_else(|e| format!("# the masked document could not be serialized: {e}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_prints_masked() {
        let secret = Secret::from("hunter2");
        assert_eq!(format!("{secret} {secret:?}"), "*** ***");
        assert_eq!(format!("{:?}", Some(secret.clone())), "Some(***)");
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn a_document_is_masked_where_it_holds_secrets() {
        let text = "\
bridge: {id: b}
sessions:
  - id: plain
    transport: mqtt
    options: {session: {username: u, password: hunter2}}
  - id: from-env
    transport: mqtt
    options: {session: {password: '${MQTT_PASSWORD}'}}
  - id: env-with-default
    transport: mqtt
    options: {session: {password: '${MQTT_PASSWORD:-hunter3}'}}
  - id: empty-default
    transport: mqtt
    options: {session: {password: '${MQTT_PASSWORD:-}'}}
  - id: numeric
    transport: mqtt
    options: {session: {password: 123456}}
stores:
  outbox: {type: postgres, options: {url: 'postgres://ferry:s3cr@t/x@db:5432/ferry'}}
  dlq: {type: postgres, options: {url: 'postgres://ferry@db/ferry'}}
";
        let masked = mask_yaml(text);
        for secret in ["hunter2", "hunter3", "123456", "s3cr@t/x"] {
            assert!(!masked.contains(secret), "{secret} in {masked}");
        }
        let value: Value = serde_saphyr::from_str(&masked).expect("yaml");
        let password = |i: usize| value["sessions"][i]["options"]["session"]["password"].clone();
        assert_eq!(password(0), MASK);
        assert_eq!(password(1), "${MQTT_PASSWORD}");
        assert_eq!(password(2), MASK);
        assert_eq!(password(3), "${MQTT_PASSWORD:-}");
        assert_eq!(password(4), MASK);
        assert_eq!(
            value["stores"]["outbox"]["options"]["url"],
            "postgres://ferry:***@db:5432/ferry"
        );
        assert_eq!(
            value["stores"]["dlq"]["options"]["url"],
            "postgres://ferry@db/ferry"
        );
        assert_eq!(value["sessions"][0]["options"]["session"]["username"], "u");
    }

    #[test]
    fn a_url_is_shown_without_its_password() {
        assert_eq!(mask_url("mqtt://u:hunter2@h:1883"), "mqtt://u:***@h:1883");
        assert_eq!(mask_url("mqtt://u@h"), "mqtt://u@h");
        // A raw `/` may be part of a password, so an `@` in the path errs on the safe side.
        assert_eq!(mask_url("tcp://h:1883/a@b"), "tcp://h:***@b");
    }

    #[test]
    fn a_document_without_secrets_comes_back_as_written() {
        let text = "# a comment\nbridge: {id: b}\nsessions: []\n";
        assert_eq!(mask_yaml(text), text);
        assert!(mask_yaml("a: [").starts_with("# the stored document could not be parsed"));
    }
}
