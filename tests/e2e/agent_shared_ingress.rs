//! Shared ingress (issue 19, item 4): two agents take one MQTT source as members of one v5
//! shared subscription (`$share/ingest/{run}/in`), on one PostgreSQL outbox and lease. The
//! broker splits the messages between the members; a member killed with SIGKILL keeps its
//! persistent session, and Mosquitto (2.0.11) goes on queueing that session's share for it.
//! Those messages are recovered by a replacement with the same identity (MQTT client id):
//! here the same agent restarted with the same configuration, in Kubernetes a StatefulSet pod
//! (`deploy/kubernetes/agent-shared.yaml`).

use std::time::Duration;

use ferry_tests::postgres::TestDatabase;
use ferry_tests::wait;

use crate::agent_failover::{Pair, postgres_lease, postgres_stores};

const DELIVERY: Duration = Duration::from_secs(120);

#[tokio::test]
async fn a_killed_shared_subscription_member_is_replaced_by_its_identity_and_nothing_is_lost()
-> anyhow::Result<()> {
    const N: u64 = 600;
    let database = TestDatabase::create().await?;
    let url = database.url()?;
    let mut pair = Pair::start(
        postgres_stores(&url, &postgres_lease(&url)),
        Vec::new(),
        |bridge| bridge.share_group = Some("ingest".into()),
    )
    .await?;
    let received = |pair: &Pair, i: usize| -> anyhow::Result<u64> {
        Ok(pair.agents[i].metrics()?.binding("r", "x").received)
    };

    // The first half, with both members up: each takes a share, and no message is taken twice.
    pair.publish(0..N / 2, 50, Duration::from_millis(50))
        .await??;
    for binding in &pair.bridge.bindings {
        pair.collector
            .wait_for(&pair.bridge.output(binding), 0..N / 2, DELIVERY)
            .await?;
    }
    let shares = [received(&pair, 0)?, received(&pair, 1)?];
    println!("shares of the first {} messages: {shares:?}", N / 2);
    assert!(
        shares.iter().all(|&s| s > 0),
        "one member took everything: {shares:?}"
    );
    assert_eq!(
        shares[0] + shares[1],
        N / 2,
        "a message was taken by both members"
    );

    // The second half after member 0 was killed: its share waits in its session.
    pair.agents[0].kill()?;
    pair.publish(N / 2..N, 50, Duration::from_millis(50))
        .await??;
    let x = pair.bridge.output("x");
    // Everything the survivor took is delivered (what it appended since the kill, on top of
    // the first half); what is still missing then is the killed member's queued share.
    wait::until_ok(DELIVERY, "the survivor's share delivered", || {
        let outcome = received(&pair, 1).and_then(|now| {
            let expected = N / 2 + (now - shares[1]);
            let distinct = pair.collector.counts().distinct(&x) as u64;
            anyhow::ensure!(distinct == expected, "{distinct} of {expected} delivered");
            Ok(())
        });
        std::future::ready(outcome)
    })
    .await?;
    let missing = pair.collector.counts().missing(&x, 0..N).len();
    println!(
        "queued for the killed member's session until it reconnects: {missing} of {}",
        N / 2
    );
    assert!(
        missing > 0,
        "the broker handed the killed member's share to the survivor"
    );

    // A replacement with the same identity (configuration, client ids, agent id) gets them.
    pair.agents[0].restart()?;
    pair.agents[0].wait_ready(Duration::from_secs(20)).await?;
    pair.conserved(N).await?;
    Ok(())
}
