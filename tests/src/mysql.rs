//! A fresh MySQL / MariaDB database per test.
//!
//! [`TestMysql::create`] makes a database `ferry_test_<unique>` on the server named by
//! `$FERRY_TEST_MYSQL` (a `mysql://user[:password]@host:port` URL, default
//! `mysql://root@127.0.0.1:3306`; the user must be allowed to create databases) and drops it
//! when the value is dropped (best effort).

use anyhow::Context;
use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use crate::ids;

/// The server used when `$FERRY_TEST_MYSQL` is not set.
pub const DEFAULT_SERVER: &str = "mysql://root@127.0.0.1:3306";

/// A database that exists for the life of the value.
pub struct TestMysql {
    server: String,
    name: String,
}

impl TestMysql {
    /// Creates a new, empty database on the test server.
    pub async fn create() -> anyhow::Result<Self> {
        let server = server();
        let name = ids::unique("ferry_test").replace('-', "_");
        let mut admin = Conn::from_url(server.as_str())
            .await
            .with_context(|| format!("connecting to MySQL ({server}); or set FERRY_TEST_MYSQL"))?;
        admin
            .query_drop(format!("CREATE DATABASE {name}"))
            .await
            .with_context(|| format!("creating the database {name}"))?;
        admin.disconnect().await.ok();
        Ok(Self { server, name })
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `mysql://host:port/name`, without the user (the agent takes it as an option).
    pub fn url_without_user(&self) -> String {
        let rest = self.server.split_once("://").map_or("", |(_, r)| r);
        let address = rest.rsplit_once('@').map_or(rest, |(_, a)| a);
        format!("mysql://{address}/{}", self.name)
    }

    /// A connection to the database.
    pub async fn connect(&self) -> anyhow::Result<Conn> {
        Conn::from_url(format!("{}/{}", self.server, self.name).as_str())
            .await
            .with_context(|| format!("connecting to the database {}", self.name))
    }
}

impl Drop for TestMysql {
    fn drop(&mut self) {
        // Drop cannot await, and may run inside a runtime: drop the database from a thread with
        // its own runtime, and wait for it so the database is gone when the test ends.
        let server = self.server.clone();
        let name = self.name.clone();
        let dropper = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("building a runtime")?;
            runtime.block_on(async {
                let mut admin = Conn::from_url(server.as_str()).await?;
                admin
                    .query_drop(format!("DROP DATABASE IF EXISTS {name}"))
                    .await
                    .context("dropping the database")?;
                admin.disconnect().await.ok();
                anyhow::Ok(())
            })
        });
        match dropper.join() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!(
                "ferry-tests: could not drop the database {}: {error:#}",
                self.name
            ),
            Err(_) => eprintln!("ferry-tests: dropping the database {} panicked", self.name),
        }
    }
}

/// `$FERRY_TEST_MYSQL` or [`DEFAULT_SERVER`].
pub fn server() -> String {
    std::env::var("FERRY_TEST_MYSQL").unwrap_or_else(|_| DEFAULT_SERVER.to_owned())
}
