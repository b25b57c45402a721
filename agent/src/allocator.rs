//! The agent's allocator: jemalloc, not the C library's `malloc` (ADR 0016).
//!
//! The agent's records and messages are allocated on one thread and freed on
//! another (the SQLite writer, the Tokio workers), which empties glibc's
//! per-thread caches; a fan-out spent a fifth of its instructions in
//! `malloc` and `free`. The settings are compiled in by `.cargo/config.toml`,
//! which cargo reads only when it runs inside this repository: a build from
//! elsewhere gets jemalloc's defaults, about 4 MiB more in the fan-out
//! benchmark, and says so at start.

/// The settings `docs/benchmarks.md` measured (session 37), as
/// `.cargo/config.toml` passes them to jemalloc's build.
pub const MEASURED: &str = "narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0,tcache_max:1024";

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Logs a warning when this build's jemalloc was not built with
/// [`MEASURED`] (`_RJEM_MALLOC_CONF` may still change them at run time, on
/// purpose, and is not checked).
pub fn warn_unless_measured() {
    match built() {
        Ok(built) if built == MEASURED => {}
        Ok(built) => tracing::warn!(
            built,
            measured = MEASURED,
            "jemalloc was built without the settings of .cargo/config.toml (built from outside \
             the repository?): the agent may use more memory than docs/benchmarks.md shows"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot read jemalloc's settings"),
    }
}

/// The settings this build's jemalloc was configured with (the crate
/// returns them with the C string's NUL).
fn built() -> Result<&'static str, tikv_jemalloc_ctl::Error> {
    tikv_jemalloc_ctl::config::malloc_conf::read().map(|s| s.trim_end_matches('\0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `.cargo/config.toml` reached jemalloc's build (the compiled-in string,
    /// which `_RJEM_MALLOC_CONF` does not change).
    #[test]
    fn jemalloc_is_built_with_the_measured_settings() {
        assert_eq!(built().expect("config.malloc_conf"), MEASURED);
    }

    /// And they are in force unless overridden on purpose.
    #[test]
    fn the_measured_settings_are_in_force() {
        if std::env::var_os("_RJEM_MALLOC_CONF").is_some() {
            return;
        }
        assert_eq!(
            tikv_jemalloc_ctl::opt::narenas::read().expect("opt.narenas"),
            1
        );
        assert_eq!(
            tikv_jemalloc_ctl::opt::tcache_max::read().expect("opt.tcache_max"),
            1024
        );
    }
}
