//! Configuration documents as the control plane handles them: received as
//! YAML bytes or a `google.protobuf.Struct`, validated by the shared
//! validator, edited one route at a time.
//!
//! # `${VAR}` expansion
//!
//! The control plane stores the document **as sent**, variables included:
//! the agent expands them from its own environment when it runs the
//! configuration (secrets stay on the edge node). To validate, the control
//! plane expands with an environment that knows no variables: every
//! `${NAME:-default}` takes its default, and a bare `${NAME}` is refused,
//! naming the variable. A document pushed to a fleet must therefore be valid
//! with its defaults alone; see `docs/adr/0003-control-plane-variable-expansion.md`.
//!
//! # Route edits
//!
//! `PutRoute` and `DeleteRoute` edit the stored document structurally (YAML
//! → a generic value → YAML, key order kept) and validate the result as a
//! whole. Comments and anchors of the original text are not kept.

use ferry_shared::config::{self, CheckError, MAX_CONFIG_BYTES, ValidConfig};
use serde_json::Value;
use tonic::Status;

use super::status::rejected;

/// Expands `${NAME:-default}` to its default; every bare `${NAME}` is unset.
fn no_variables(_: &str) -> Option<String> {
    None
}

/// Validates a document's text; `INVALID_ARGUMENT` listing every problem.
pub fn validate(text: &str) -> Result<ValidConfig, Status> {
    config::check_bytes(text.as_bytes(), &no_variables)
        .map_err(|error: CheckError| rejected("configuration rejected", &error.messages()))
}

/// The document text of an apply request.
pub fn from_request(
    document: Option<ferry_shared::api::v1::apply_config_request::Document>,
) -> Result<String, Status> {
    use ferry_shared::api::v1::apply_config_request::Document;
    match document {
        None => Err(Status::invalid_argument(
            "document: must be set (yaml or structured)",
        )),
        Some(Document::Yaml(bytes)) => {
            check_size(bytes.len())?;
            String::from_utf8(bytes).map_err(|e| {
                let line = e.as_bytes()[..e.utf8_error().valid_up_to()]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1;
                rejected(
                    "configuration rejected",
                    &[format!("configuration is not valid UTF-8 (line {line})")],
                )
            })
        }
        Some(Document::Structured(structured)) => {
            let value = struct_to_value(structured);
            let text = to_yaml(&value)?;
            check_size(text.len())?;
            Ok(text)
        }
    }
}

fn check_size(size: usize) -> Result<(), Status> {
    if size > MAX_CONFIG_BYTES {
        return Err(rejected(
            "configuration rejected",
            &[format!(
                "configuration is {size} bytes, more than the limit of {MAX_CONFIG_BYTES} bytes"
            )],
        ));
    }
    Ok(())
}

fn struct_to_value(structured: prost_types::Struct) -> Value {
    Value::Object(
        structured
            .fields
            .into_iter()
            .map(|(key, value)| (key, proto_value(value)))
            .collect(),
    )
}

fn proto_value(value: prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match value.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        // Struct numbers are doubles; whole numbers become integers so that
        // `port: 1883` stays an integer for the typed model.
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => Value::from(n as i64),
        Some(Kind::NumberValue(n)) => {
            serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number)
        }
        Some(Kind::StringValue(s)) => Value::String(s),
        Some(Kind::ListValue(list)) => {
            Value::Array(list.values.into_iter().map(proto_value).collect())
        }
        Some(Kind::StructValue(s)) => struct_to_value(s),
    }
}

fn to_yaml(value: &Value) -> Result<String, Status> {
    serde_saphyr::to_string(value)
        .map_err(|e| Status::internal(format!("serializing the configuration: {e}")))
}

fn parse_value(text: &str, what: &str) -> Result<Value, Status> {
    serde_saphyr::from_str::<Value>(text).map_err(|e| {
        rejected(
            &format!("{what} rejected"),
            &[format!("{what} is not valid YAML: {e}")],
        )
    })
}

fn routes_mut(document: &mut Value) -> Result<&mut Vec<Value>, Status> {
    let Value::Object(map) = document else {
        return Err(Status::internal(
            "the stored configuration is not a mapping",
        ));
    };
    let routes = map
        .entry("routes")
        .or_insert_with(|| Value::Array(Vec::new()));
    if routes.is_null() {
        *routes = Value::Array(Vec::new());
    }
    routes
        .as_array_mut()
        .ok_or_else(|| Status::internal("the stored configuration's routes is not a list"))
}

fn route_id(route: &Value) -> Option<&str> {
    route.get("id").and_then(Value::as_str)
}

/// One route of a stored document as a YAML mapping, if it exists.
pub fn get_route(document: &str, id: &str) -> Result<Option<String>, Status> {
    let mut value = parse_value(document, "stored configuration")?;
    let routes = routes_mut(&mut value)?;
    routes
        .iter()
        .find(|route| route_id(route) == Some(id))
        .map(to_yaml)
        .transpose()
}

/// The document with `route_yaml` added (or replacing the route of the same
/// id), not yet validated.
pub fn put_route(document: &str, route_yaml: &[u8]) -> Result<String, Status> {
    check_size(route_yaml.len())?;
    let text = std::str::from_utf8(route_yaml)
        .map_err(|_| rejected("route rejected", &["route_yaml: not valid UTF-8".into()]))?;
    let route = parse_value(text, "route")?;
    if !matches!(route, Value::Object(_)) {
        return Err(rejected(
            "route rejected",
            &["route_yaml: must be a YAML mapping (one entry of `routes`)".into()],
        ));
    }
    let Some(id) = route_id(&route)
        .map(str::to_owned)
        .filter(|id| !id.is_empty())
    else {
        return Err(rejected(
            "route rejected",
            &["route_yaml.id: must be a non-empty string".into()],
        ));
    };
    let mut value = parse_value(document, "stored configuration")?;
    let routes = routes_mut(&mut value)?;
    match routes.iter_mut().find(|r| route_id(r) == Some(&id)) {
        Some(existing) => *existing = route,
        None => routes.push(route),
    }
    to_yaml(&value)
}

/// The document without route `id`; `None` when it has no such route.
pub fn delete_route(document: &str, id: &str) -> Result<Option<String>, Status> {
    let mut value = parse_value(document, "stored configuration")?;
    let routes = routes_mut(&mut value)?;
    let before = routes.len();
    routes.retain(|route| route_id(route) != Some(id));
    if routes.len() == before {
        return Ok(None);
    }
    to_yaml(&value).map(Some)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const DOC: &str =
        "bridge:\n  id: b\nroutes:\n  - id: r1\n    receiver: x\n  - id: r2\n    receiver: y\n";

    #[test]
    fn edits_routes_structurally() {
        let r1 = get_route(DOC, "r1").unwrap().unwrap();
        assert!(r1.contains("receiver: x"), "{r1}");
        assert!(get_route(DOC, "nope").unwrap().is_none());
        let replaced = put_route(DOC, b"id: r1\nreceiver: z\n").unwrap();
        assert!(replaced.contains("receiver: z") && !replaced.contains("receiver: x"));
        assert!(
            replaced.find("r1") < replaced.find("r2"),
            "order kept: {replaced}"
        );
        let removed = delete_route(DOC, "r2").unwrap().unwrap();
        assert!(!removed.contains("r2"));
        assert!(delete_route(DOC, "nope").unwrap().is_none());
    }

    #[test]
    fn bare_variables_are_refused_and_defaults_used() {
        let error = validate("bridge:\n  id: ${BRIDGE}\n").unwrap_err();
        assert!(error.message().contains("BRIDGE"), "{}", error.message());
        // With a default the document gets past expansion (and on to the
        // validator, which wants routes).
        let error = validate("bridge:\n  id: ${BRIDGE:-b1}\n").unwrap_err();
        assert!(!error.message().contains("BRIDGE"), "{}", error.message());
        assert!(error.message().contains("routes"), "{}", error.message());
    }

    #[test]
    fn structured_documents_keep_integers() {
        let mut fields = std::collections::BTreeMap::new();
        fields.insert(
            "port".to_owned(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::NumberValue(1883.0)),
            },
        );
        let value = struct_to_value(prost_types::Struct { fields });
        assert_eq!(to_yaml(&value).unwrap().trim(), "port: 1883");
    }
}
