//! Configuration apply decisions, shared by every backend. A backend reads
//! the bridge's current version under a write lock, asks [`decide_apply`]
//! what to store, writes it and commits.

use std::time::SystemTime;

use super::codec::{digest, require_id};
use super::error::{StateError, StateResult};
use super::paging::{Page, PageRequest, paginate};
use super::types::{ApplyConfig, ConfigVersion, StoredConfig};

/// What an apply does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ApplyDecision {
    /// Store this as the new current version.
    Store(StoredConfig),
    /// Document and selector equal the current version: store nothing.
    Unchanged(StoredConfig),
}

/// Decides an apply given the bridge's current version (if any).
pub(crate) fn decide_apply(
    current: Option<StoredConfig>,
    apply: &ApplyConfig,
    now: SystemTime,
) -> StateResult<ApplyDecision> {
    require_id("bridge id", &apply.bridge_id)?;
    let current_version = current.as_ref().map_or(0, |c| c.version);
    check_expected(apply.expected_version, current_version)?;
    if let Some(current) = current
        && current.yaml == apply.yaml
        && current.selector == apply.selector
    {
        return Ok(ApplyDecision::Unchanged(current));
    }
    let version = current_version
        .checked_add(1)
        .ok_or_else(|| StateError::corrupt("configuration version overflow"))?;
    Ok(ApplyDecision::Store(StoredConfig {
        bridge_id: apply.bridge_id.clone(),
        version,
        yaml: apply.yaml.clone(),
        selector: apply.selector.clone(),
        change_note: apply.change_note.clone(),
        created_at: now,
        digest: digest(&apply.yaml),
        applied_by: apply.applied_by.clone(),
    }))
}

/// The compare-and-swap check: `expected` (if given) must equal `current`
/// (0 = does not exist).
pub(crate) fn check_expected(expected: Option<u64>, current: u64) -> StateResult<()> {
    match expected {
        Some(expected) if expected != current => Err(StateError::Conflict { current }),
        _ => Ok(()),
    }
}

/// The `NotFound` error for a bridge (and version).
pub(crate) fn config_not_found(bridge_id: &str, version: Option<u64>) -> StateError {
    match version {
        Some(v) => StateError::not_found(format!("configuration {bridge_id:?} version {v}")),
        None => StateError::not_found(format!("configuration {bridge_id:?}")),
    }
}

/// The listing kind of history page tokens.
const VERSIONS_KIND: &str = "config_versions";

/// The `version < ?` bound of a history page.
pub(crate) fn versions_before(page: &PageRequest) -> StateResult<i64> {
    Ok(page.cursor(VERSIONS_KIND)?.map_or(i64::MAX, |c| c.number))
}

/// Cuts fetched history rows to a page.
pub(crate) fn versions_page(page: &PageRequest, rows: Vec<ConfigVersion>) -> Page<ConfigVersion> {
    paginate(page, VERSIONS_KIND, rows, |v| {
        (String::new(), i64::try_from(v.version).unwrap_or(i64::MAX))
    })
}
