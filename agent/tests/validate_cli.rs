//! `ferry-agent validate FILE`: exit 0 and `ok` for a valid file, exit 2 and every problem on
//! stderr otherwise.

use std::io::Write;
use std::process::{Command, Output};

const VALID: &str = include_str!("../../shared/src/config/testdata/seed_main.yaml");

fn validate_text(text: &str) -> Output {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(text.as_bytes()).expect("write");
    validate_path(file.path())
}

fn validate_path(path: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry-agent"))
        .arg("validate")
        .arg(path)
        .env_remove("FERRY_TEST_UNSET")
        .output()
        .expect("run ferry-agent")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn valid_file_prints_ok_and_exits_0() {
    let out = validate_text(VALID);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
}

#[test]
fn invalid_file_prints_every_error_and_exits_2() {
    let text = VALID
        .replace(
            "bindings: [to-events, to-audit, to-analytics]",
            "bindings: [to-events, to-audit, to-nowhere]",
        )
        .replace("        qos: 1\n\nsenders", "        qos: 3\n\nsenders");
    let out = validate_text(&text);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines.contains(&"routes[0].bindings[2]: unknown binding \"to-nowhere\""),
        "{err}"
    );
    assert!(
        lines.contains(&"receivers[0].topics[0].qos: qos must be 0, 1 or 2, got 3"),
        "{err}"
    );
    assert_eq!(lines.len(), 2, "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn yaml_syntax_error_names_line_and_column_and_exits_2() {
    let out = validate_text("bridge:\n  id: b\nroutes: [\n");
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("yaml error at line 3 column"), "{err}");
}

#[test]
fn unknown_key_exits_2_with_its_location() {
    let out = validate_text(&VALID.replace("  id: durable-sensor-ingest", "  id: x\n  name: y"));
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("unknown field `name`") && err.contains("line 3 column 3"),
        "{err}"
    );
}

#[test]
fn unset_variable_exits_2_naming_it() {
    let out = validate_text(&VALID.replace("durable-ingest-01", "${FERRY_TEST_UNSET}"));
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("FERRY_TEST_UNSET") && err.contains("line 10"),
        "{err}"
    );
}

#[test]
fn unreadable_file_exits_2() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = validate_path(&dir.path().join("missing.yaml"));
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cannot read"), "{}", stderr(&out));
}
