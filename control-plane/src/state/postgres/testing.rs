//! Test-only: a fresh PostgreSQL database per test, dropped afterwards (best
//! effort, also when the test panics).
//!
//! The server is `FERRY_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, trust auth); each database
//! is named `ferry_state_<random>`.

use tokio_postgres::NoTls;

const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A database created for one test.
#[derive(Debug)]
pub(crate) struct TestDatabase {
    admin_url: String,
    name: String,
    url: String,
}

impl TestDatabase {
    /// Creates an empty database; panics (failing the test) when the server
    /// cannot be reached.
    pub(crate) async fn create() -> Self {
        let admin_url =
            std::env::var("FERRY_TEST_POSTGRES_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.into());
        let name = format!("ferry_state_{}", uuid::Uuid::now_v7().simple());
        admin_execute(&admin_url, &format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("creating test database on {admin_url}: {e}"));
        let base = admin_url
            .rsplit_once('/')
            .map_or(admin_url.as_str(), |(base, _)| base);
        let url = format!("{base}/{name}");
        Self {
            admin_url,
            name,
            url,
        }
    }

    /// The database's URL.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Runs statements in the database; panics (failing the test) on error.
    pub(crate) async fn execute(&self, statements: &str) {
        admin_execute(&self.url, statements)
            .await
            .unwrap_or_else(|e| panic!("executing on {}: {e}", self.name));
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let statement = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        // Drop may run inside a runtime, which must not block on another;
        // a plain thread with its own runtime does the async cleanup.
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(admin_execute(&admin_url, &statement))
        });
        if let Ok(Err(e)) = cleanup.join() {
            eprintln!("dropping test database {}: {e}", self.name);
        }
    }
}

async fn admin_execute(admin_url: &str, statement: &str) -> Result<(), String> {
    let (client, connection) = tokio_postgres::connect(admin_url, NoTls)
        .await
        .map_err(|e| e.to_string())?;
    let driver = tokio::spawn(connection);
    let result = client
        .batch_execute(statement)
        .await
        .map_err(|e| e.to_string());
    drop(client);
    // The connection task ends once the client is gone.
    let _ = driver.await;
    result
}
