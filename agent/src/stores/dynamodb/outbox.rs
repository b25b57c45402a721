//! The DynamoDB outbox: a message item and a narrow record item per binding
//! (ADR 0007), a fence item and a counter item per partition (the layout is
//! in the module above), shared by every agent that feeds or drains the
//! partition.
//!
//! # How the invariants hold with several agents
//!
//! 1. **Seqs.** An append is one transaction: the counter item's `last_seq`
//!    set from the value read to that plus the message's record count, on
//!    the condition that it still holds the value read, with the message
//!    and record items (each on the condition that its key is new). Of two
//!    appends reading the same counter one commits, the other reads again:
//!    seqs are strictly increasing, never reused, and their order is the
//!    order appends committed in. Appends of one store to one partition
//!    take turns (a lock per partition, the counter cached under it), so
//!    they do not race each other; appends of other agents are the races.
//! 2. **All or nothing.** That transaction holds every record of the
//!    message, so a message is stored whole or not at all; at most
//!    [`MAX_TRANSACTION`] − 2 bindings per message.
//! 3. **The fence and void claims.** The fence item's `hwm` is raised by a
//!    conditional update (`hwm < v`) before a claim or expiry at a higher
//!    version reads anything. A record's claim counts only while its
//!    `claim_version` equals `hwm`: raising the mark therefore makes every
//!    older claim pending in the same single write, whatever the number of
//!    records (a *void* claim is shown, counted and claimed as pending; it
//!    is overwritten when the record is claimed again).
//! 4. **Claims** read the partition's records in seq order (a consistent
//!    `Query` from seq 1), choose up to `limit` claimable ones, and claim
//!    each with an update whose condition is what made it claimable
//!    (pending or void, or the owner's own claim at `v` older than
//!    `stale_claim_duration`; for an expiry, pending or void and expired).
//!    Of two agents claiming one record, one update fails its condition and
//!    that record is left out of its answer. A claim at `v` that races a
//!    raise to `v + 1` may still write `v` after it: a void claim, pending
//!    for the new holder, whose completions at `v` are `Stale`.
//!    Each claiming call writes a fresh `claim_token` with its claims and
//!    also accepts a record already claimed with that token: the SDK
//!    resends an update whose answer was lost (a 5xx or a timeout after
//!    the write applied), and the resent update must return the record,
//!    not fail its condition and leave it claimed by nobody who knows.
//! 5. **Completions and releases** read the records named (consistent
//!    `BatchGetItem`), keep those claimed at exactly `v`, and change them
//!    in transactions that also check the fence (`hwm <= v`) and each
//!    record's `claim_version = v`: a raise or another agent's claim in
//!    between cancels the transaction, and the call reads again (a raise
//!    makes it `Stale`). A completion the SDK resent after its answer was
//!    lost finds its records gone; as only the holder of `v` completes at
//!    `v`, records read claimed at `v` and gone after a cancelled
//!    completion of this call count as completed by it (they were: counting
//!    them keeps the drainer's figures exact).
//! 6. **A message goes with its last record.** A completion groups the
//!    records it deletes by message and reads which records of each message
//!    are left (none when it deletes every seq of the message). The transaction deleting a message's last records deletes
//!    the message item too; one that leaves records checks that they still
//!    exist, so that of two completions emptying one message at once the
//!    second is cancelled, reads again and deletes the message item. A
//!    message's records, its deletion and its checks fit one transaction
//!    (invariant 2), so no crash leaves a message item without records.
//! 7. **A failed claim owes its records.** A claim is many updates, not one
//!    transaction: when the call fails, some of the records it chose may be
//!    claimed (earlier updates applied, or a failed one applied before its
//!    answer was lost). The store keeps the chosen seqs with the token each
//!    update wrote, the owner and the version, and the owner's next `claim`
//!    at that version claims the oldest of them first (at most `limit`)
//!    with that same token, which its condition accepts: the drainer gets
//!    them back at once instead of after `stale_claim_duration` (the
//!    stores' invariant 5). A record of them that is pending is simply
//!    claimed; one claimed by any other call (another agent, or a
//!    concurrent call of the same owner that won it and returned it) has
//!    another token and is left out, so nothing is returned twice. What a
//!    failed `expire` chose is owed to the next `claim` too (the drainer
//!    disposes of expired records it claims).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use aws_sdk_dynamodb::types::{
    ConditionCheck, Delete, Put, ReturnValue, TransactWriteItem, Update,
};
use futures::{StreamExt, stream};

use super::{
    DynamoDbOptions, Item, MAX_TRANSACTION, Table, b, build_error, check_size, condition_failed,
    get_b, get_n, get_s, n, opt_n, opt_s, s, transient_cancel,
};
use crate::stores::outbox::{Names, RawRecord, into_records, stale, stale_before, validate_append};
use crate::stores::{
    BoxFuture, NewMessage, OutboxRecord, OutboxStats, OutboxStore, Release, StoreError,
    StoreResult, from_unix_nanos, unix_nanos,
};

/// The sort key of the fence and the counter items; records and messages
/// start at seq 1.
const HEAD: u64 = 0;
/// The highest seq a query asks for (seqs are stored as `i64` elsewhere).
const LAST: u64 = i64::MAX as u64;
/// Records one claim writes at once.
const CLAIM_CONCURRENCY: usize = 16;
/// Items a query page holds at most when every item is wanted.
const PAGE: i32 = 1000;

/// A record's claim condition (invariant 4).
const CLAIMABLE: &str = "attribute_exists(pk) AND (attribute_not_exists(claim_version) \
    OR claim_version < :v OR (claim_version = :v AND claim_owner = :o \
    AND (claimed_at <= :stale OR claim_token = :t)))";
/// A record's expiry condition (invariant 4).
const EXPIRABLE: &str = "attribute_exists(pk) AND (attribute_not_exists(claim_version) \
    OR claim_version < :v OR (claim_version = :v AND claim_owner = :o AND claim_token = :t)) \
    AND expires_at <= :now";
/// What a settle removes with a claim.
const UNCLAIM: &str = "REMOVE claim_version, claim_owner, claimed_at, claim_token";

/// An outbox in a DynamoDB table.
pub struct DynamoDbOutboxStore {
    table: Table,
    options: DynamoDbOptions,
    /// Per partition: the turn of this store's appends, and the counter as
    /// the last of them left it (`None`: read it).
    appenders: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<u64>>>>>,
    /// Per partition and owner: what failed claiming calls owe, and the
    /// version they claimed at (invariant 7).
    owed: Mutex<HashMap<(String, String), Owed>>,
}

/// What failed claiming calls may have claimed under one version: each seq
/// with the token its update wrote.
type Owed = (u64, BTreeMap<u64, String>);

/// The key of the fence and the records of `partition`.
fn records_pk(partition: &str) -> String {
    format!("r:{partition}")
}

/// The key of the counter and the messages of `partition`.
fn messages_pk(partition: &str) -> String {
    format!("m:{partition}")
}

fn key(pk: &str, sk: u64) -> Item {
    Item::from([("pk".to_owned(), s(pk)), ("sk".to_owned(), n(sk))])
}

/// What a claiming call picks.
#[derive(Clone, Copy)]
enum Pick {
    /// Pending records and the owner's claims made at or before this time.
    Claim { stale_before: i64 },
    /// Pending records expired at `now`.
    Expire,
}

/// One claiming call: who claims where, at which version and time, and the
/// token its updates write (invariant 4).
struct Call<'a> {
    partition: &'a str,
    /// The partition's records' key.
    rpk: String,
    owner: &'a str,
    version: u64,
    /// Unix nanoseconds.
    now: i64,
    token: String,
}

/// How claimed records are settled.
#[derive(Clone, Copy)]
enum Settle<'a> {
    Complete,
    Release(&'a Release),
}

/// Actions that go into one transaction together, and the seqs they settle.
struct Group {
    seqs: Vec<u64>,
    actions: Vec<TransactWriteItem>,
}

/// A record item as a row; a claim below `hwm` is void and reads as pending
/// (invariant 3).
/// Its binding and address are shared through `names` with the items read
/// before it.
fn raw(item: &Item, hwm: u64, names: &mut Names) -> StoreResult<RawRecord> {
    let claim_version: Option<i64> = opt_n(item, "claim_version")?;
    let live = claim_version.is_some_and(|v| u64::try_from(v).is_ok_and(|v| v >= hwm));
    let (claim_version, claim_owner, claimed_at) = if live {
        (
            claim_version,
            opt_s(item, "claim_owner")?,
            opt_n(item, "claimed_at")?,
        )
    } else {
        (None, None, None)
    };
    Ok(RawRecord {
        seq: get_n(item, "sk")?,
        msg: get_n(item, "msg")?,
        id: get_s(item, "id")?,
        binding: names.get(&get_s(item, "binding")?),
        address: names.get(&get_s(item, "address")?),
        created_at: get_n(item, "created_at")?,
        expires_at: opt_n(item, "expires_at")?,
        claim_version,
        claim_owner,
        claimed_at,
        replay_count: get_n(item, "replay_count")?,
        first_attempt_at: opt_n(item, "first_attempt_at")?,
        last_error: opt_s(item, "last_error")?,
    })
}

impl DynamoDbOutboxStore {
    /// Opens the store with a client from the standard credential chain.
    pub async fn open(options: DynamoDbOptions) -> StoreResult<Self> {
        let client = options.client().await;
        Self::open_with(client, options).await
    }

    /// Opens the store with `client`.
    pub async fn open_with(
        client: aws_sdk_dynamodb::Client,
        options: DynamoDbOptions,
    ) -> StoreResult<Self> {
        let table = Table::open(client, &options, true).await?;
        Ok(DynamoDbOutboxStore {
            table,
            options,
            appenders: Mutex::new(HashMap::new()),
            owed: Mutex::new(HashMap::new()),
        })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &DynamoDbOptions {
        &self.options
    }

    /// The client it uses.
    pub fn client(&self) -> &aws_sdk_dynamodb::Client {
        &self.table.client
    }

    /// One item, strongly consistent.
    async fn get(&self, pk: &str, sk: u64) -> StoreResult<Option<Item>> {
        let out = self
            .table
            .client
            .get_item()
            .table_name(&self.table.name)
            .set_key(Some(key(pk, sk)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.table.error("GetItem", &e))?;
        Ok(out.item().cloned())
    }

    /// The partition's high-water mark (0 before any claim).
    async fn hwm(&self, partition: &str) -> StoreResult<u64> {
        match self.get(&records_pk(partition), HEAD).await? {
            Some(item) => Ok(opt_n(&item, "hwm")?.unwrap_or(0)),
            None => Ok(0),
        }
    }

    /// Checks `version` against the mark and raises the mark to it
    /// (invariant 3).
    async fn fence(&self, partition: &str, version: u64) -> StoreResult<()> {
        let hwm = self.hwm(partition).await?;
        if version < hwm {
            return Err(stale(partition, version, hwm));
        }
        if version == hwm {
            return Ok(());
        }
        let raised = self
            .table
            .client
            .update_item()
            .table_name(&self.table.name)
            .set_key(Some(key(&records_pk(partition), HEAD)))
            .update_expression("SET hwm = :v")
            .condition_expression("attribute_not_exists(hwm) OR hwm < :v")
            .expression_attribute_values(":v", n(version))
            .send()
            .await;
        match raised {
            Ok(_) => Ok(()),
            // Raised meanwhile: to this version (fine) or beyond (stale).
            Err(e) if condition_failed(&e) => {
                let hwm = self.hwm(partition).await?;
                if version < hwm {
                    Err(stale(partition, version, hwm))
                } else {
                    Ok(())
                }
            }
            Err(e) => Err(self.table.error("UpdateItem", &e)),
        }
    }

    /// The turn of this store's appends to `partition` (invariant 1).
    fn appender(&self, partition: &str) -> Arc<tokio::sync::Mutex<Option<u64>>> {
        let mut appenders = self
            .appenders
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Arc::clone(appenders.entry(partition.to_owned()).or_default())
    }

    async fn append_now(&self, partition: &str, message: NewMessage) -> StoreResult<Vec<u64>> {
        validate_append(partition, &message)?;
        let count = message.records.len() as u64;
        if count == 0 {
            return Ok(Vec::new());
        }
        if message.records.len() + 2 > MAX_TRANSACTION {
            return Err(StoreError::Invalid(format!(
                "a message for {count} bindings: a dynamodb outbox stores at most {} per message",
                MAX_TRANSACTION - 2
            )));
        }
        let (rpk, mpk) = (records_pk(partition), messages_pk(partition));
        let created_at = unix_nanos(message.created_at)?;
        let expires_at = message.expires_at.map(unix_nanos).transpose()?;
        let envelope = b(message.envelope.encode());
        let turn = self.appender(partition);
        let mut cached = turn.lock().await;
        let mut attempt = 0;
        loop {
            // Forgotten until the transaction is known to have committed.
            let old = match cached.take() {
                Some(last) => last,
                None => match self.get(&mpk, HEAD).await? {
                    Some(item) => opt_n(&item, "last_seq")?.unwrap_or(0),
                    None => 0,
                },
            };
            let (first, last) = (old + 1, old + count);
            let counter = Update::builder()
                .table_name(&self.table.name)
                .set_key(Some(key(&mpk, HEAD)))
                .update_expression("SET last_seq = :new")
                .condition_expression(if old == 0 {
                    "attribute_not_exists(last_seq)"
                } else {
                    "last_seq = :old"
                })
                .expression_attribute_values(":new", n(last));
            let counter = if old == 0 {
                counter
            } else {
                counter.expression_attribute_values(":old", n(old))
            };
            let mut message_item = key(&mpk, first);
            message_item.insert("last_seq".to_owned(), n(last));
            message_item.insert("envelope".to_owned(), envelope.clone());
            check_size(&message_item, &format!("the message of outbox {partition}"))?;
            let mut actions = vec![
                TransactWriteItem::builder()
                    .update(counter.build().map_err(build_error)?)
                    .build(),
                self.put_new(message_item)?,
            ];
            for (r, seq) in message.records.iter().zip(first..) {
                let mut item = key(&rpk, seq);
                item.extend([
                    ("msg".to_owned(), n(first)),
                    ("msg_last".to_owned(), n(last)),
                    ("id".to_owned(), s(&r.id)),
                    ("binding".to_owned(), s(&*r.binding)),
                    ("address".to_owned(), s(&*r.address)),
                    ("created_at".to_owned(), n(created_at)),
                    ("replay_count".to_owned(), n(0)),
                ]);
                if let Some(at) = expires_at {
                    item.insert("expires_at".to_owned(), n(at));
                }
                check_size(&item, &format!("record {} of outbox {partition}", r.id))?;
                actions.push(self.put_new(item)?);
            }
            match self.table.transact(actions).await? {
                Ok(()) => {
                    *cached = Some(last);
                    return Ok((first..=last).collect());
                }
                // The counter moved (another agent appended, or this very
                // transaction applied and was resent) or a concurrent
                // transaction was in the way: read again.
                Err(codes)
                    if codes.first().is_some_and(|c| c == "ConditionalCheckFailed")
                        || transient_cancel(&codes) =>
                {
                    if self.holds(&rpk, first, &message.records[0].id).await? {
                        *cached = Some(last);
                        return Ok((first..=last).collect());
                    }
                    attempt += 1;
                    self.table
                        .pause(attempt, &format!("append to {partition} lost a race"))
                        .await?;
                }
                Err(codes) => {
                    return Err(StoreError::Corrupt(format!(
                        "outbox {partition}: seqs {first}..={last} are taken although the \
                         counter was at {old} ({codes:?})"
                    )));
                }
            }
        }
    }

    /// Whether record `seq` is the one with `id`: an append whose
    /// transaction the SDK resent after it applied (its answer lost) finds
    /// its own first record there. DynamoDB itself answers such a resend
    /// as a success (the SDK's idempotency token); moto does not. A record
    /// of it already completed by another agent is not found, and the
    /// message is appended again: a duplicate, never a loss.
    async fn holds(&self, rpk: &str, seq: u64, id: &str) -> StoreResult<bool> {
        Ok(match self.get(rpk, seq).await? {
            Some(item) => opt_s(&item, "id")?.as_deref() == Some(id),
            None => false,
        })
    }

    fn put_new(&self, item: Item) -> StoreResult<TransactWriteItem> {
        let put = Put::builder()
            .table_name(&self.table.name)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk)")
            .build()
            .map_err(build_error)?;
        Ok(TransactWriteItem::builder().put(put).build())
    }

    /// Claims (invariants 4 and 7).
    async fn claiming(
        &self,
        partition: &str,
        owner: &str,
        version: u64,
        limit: usize,
        now: SystemTime,
        pick: Pick,
    ) -> StoreResult<Vec<OutboxRecord>> {
        let now = unix_nanos(now)?;
        self.fence(partition, version).await?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut chosen = match pick {
            Pick::Claim { .. } => self.take_owed(partition, owner, version, limit),
            Pick::Expire => BTreeMap::new(),
        };
        let call = Call {
            partition,
            rpk: records_pk(partition),
            owner,
            version,
            now,
            token: uuid::Uuid::now_v7().to_string(),
        };
        let claimed = self.claim_chosen(&call, limit, pick, &mut chosen).await;
        if claimed.is_err() {
            self.owe(partition, owner, version, chosen);
        }
        claimed
    }

    /// Adds to `chosen` (which holds what is owed, with the tokens that
    /// claimed them) what `pick` finds, up to `limit`, and claims them all,
    /// each with its token.
    async fn claim_chosen(
        &self,
        call: &Call<'_>,
        limit: usize,
        pick: Pick,
        chosen: &mut BTreeMap<u64, String>,
    ) -> StoreResult<Vec<OutboxRecord>> {
        let Call {
            partition,
            owner,
            version,
            now,
            ..
        } = *call;
        if chosen.len() < limit {
            let page = i32::try_from(limit.saturating_add(50))
                .unwrap_or(PAGE)
                .min(PAGE);
            self.table
                .query(&call.rpk, (HEAD + 1, LAST), page, |item| {
                    let claim: Option<u64> = opt_n(&item, "claim_version")?;
                    let pending = claim.is_none_or(|c| c < version);
                    let wanted = match pick {
                        Pick::Claim { stale_before } => {
                            pending
                                || (claim == Some(version)
                                    && opt_s(&item, "claim_owner")?.as_deref() == Some(owner)
                                    && opt_n::<i64>(&item, "claimed_at")?
                                        .is_some_and(|at| at <= stale_before))
                        }
                        Pick::Expire => {
                            pending
                                && opt_n::<i64>(&item, "expires_at")?.is_some_and(|at| at <= now)
                        }
                    };
                    if wanted {
                        chosen
                            .entry(get_n::<u64>(&item, "sk")?)
                            .or_insert_with(|| call.token.clone());
                    }
                    Ok(chosen.len() < limit)
                })
                .await?;
        }
        let claims: Vec<(u64, String)> = chosen.iter().map(|(s, t)| (*s, t.clone())).collect();
        let claimed: Vec<StoreResult<Option<Item>>> = stream::iter(claims)
            .map(|(seq, token)| async move { self.claim_one(call, seq, &token, pick).await })
            .buffered(CLAIM_CONCURRENCY)
            .collect()
            .await;
        let (mut rows, mut names) = (Vec::new(), Names::default());
        for item in claimed {
            if let Some(item) = item? {
                rows.push(raw(&item, version, &mut names)?);
            }
        }
        self.with_envelopes(partition, rows).await
    }

    /// The oldest `limit` of what failed claiming calls of `owner` owe in
    /// `partition` under `version`, with their tokens (the rest stay owed;
    /// those of another version are void: invariant 3).
    fn take_owed(
        &self,
        partition: &str,
        owner: &str,
        version: u64,
        limit: usize,
    ) -> BTreeMap<u64, String> {
        let mut owed = self
            .owed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = (partition.to_owned(), owner.to_owned());
        match owed.remove(&key) {
            Some((v, mut seqs)) if v == version => {
                if let Some(&rest) = seqs.keys().nth(limit) {
                    owed.insert(key, (v, seqs.split_off(&rest)));
                }
                seqs
            }
            _ => BTreeMap::new(),
        }
    }

    /// Remembers what a failed claiming call may have claimed, each seq with
    /// the token its update wrote (invariant 7).
    fn owe(&self, partition: &str, owner: &str, version: u64, seqs: BTreeMap<u64, String>) {
        if seqs.is_empty() {
            return;
        }
        let mut owed = self
            .owed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let entry = owed
            .entry((partition.to_owned(), owner.to_owned()))
            .or_insert_with(|| (version, BTreeMap::new()));
        if entry.0 != version {
            *entry = (version, BTreeMap::new());
        }
        entry.1.extend(seqs);
    }

    /// Claims one record on the condition that chose it, or that it carries
    /// `token` (an earlier attempt of this update, or the failed call that
    /// owes it: invariants 4 and 7); `None` when another call or agent
    /// changed it first.
    async fn claim_one(
        &self,
        call: &Call<'_>,
        seq: u64,
        token: &str,
        pick: Pick,
    ) -> StoreResult<Option<Item>> {
        let update = self
            .table
            .client
            .update_item()
            .table_name(&self.table.name)
            .set_key(Some(key(&call.rpk, seq)))
            .update_expression(
                "SET claim_version = :v, claim_owner = :o, claimed_at = :now, claim_token = :t",
            )
            .expression_attribute_values(":v", n(call.version))
            .expression_attribute_values(":o", s(call.owner))
            .expression_attribute_values(":now", n(call.now))
            .expression_attribute_values(":t", s(token))
            .return_values(ReturnValue::AllNew);
        let update = match pick {
            Pick::Claim { stale_before } => update
                .condition_expression(CLAIMABLE)
                .expression_attribute_values(":stale", n(stale_before)),
            Pick::Expire => update.condition_expression(EXPIRABLE),
        };
        match update.send().await {
            Ok(out) => Ok(out.attributes().cloned()),
            Err(e) if condition_failed(&e) => Ok(None),
            Err(e) => Err(self.table.error("UpdateItem", &e)),
        }
    }

    /// Attaches their messages' envelopes to `rows` (one decoded envelope
    /// per message: the stores' invariant 8).
    async fn with_envelopes(
        &self,
        partition: &str,
        rows: Vec<RawRecord>,
    ) -> StoreResult<Vec<OutboxRecord>> {
        let mpk = messages_pk(partition);
        let msgs: BTreeSet<i64> = rows.iter().map(|r| r.msg).collect();
        let keys = msgs
            .into_iter()
            .map(|m| {
                u64::try_from(m)
                    .map(|m| key(&mpk, m))
                    .map_err(|_| StoreError::Corrupt(format!("outbox {partition}: message {m}")))
            })
            .collect::<StoreResult<Vec<_>>>()?;
        let mut envelopes = HashMap::new();
        for item in self.table.get_many(keys).await? {
            envelopes.insert(get_n::<i64>(&item, "sk")?, get_b(&item, "envelope")?);
        }
        into_records(partition, rows, |msg| Ok(envelopes.remove(&msg)))
    }

    /// Completes or releases the records among `seqs` claimed at `version`
    /// (invariants 5 and 6).
    async fn settle(
        &self,
        partition: &str,
        version: u64,
        seqs: &[u64],
        how: Settle<'_>,
    ) -> StoreResult<Vec<u64>> {
        let rpk = records_pk(partition);
        let mut wanted: BTreeSet<u64> = seqs.iter().copied().collect();
        let mut done = Vec::new();
        // Seqs of completions that were cancelled: the SDK may have resent a
        // transaction that had applied (its answer lost), which the resend
        // then finds changed.
        let mut in_doubt = BTreeSet::new();
        let mut attempt = 0;
        'read: loop {
            let hwm = self.hwm(partition).await?;
            if version < hwm {
                return Err(stale(partition, version, hwm));
            }
            if wanted.is_empty() {
                break;
            }
            let items = self
                .table
                .get_many(wanted.iter().map(|seq| key(&rpk, *seq)).collect())
                .await?;
            // Only a completion at `version`, which only this caller makes,
            // deletes a record claimed at `version` while the fence allows
            // it: one in doubt that is gone was deleted by this call — if
            // the fence still allows `version` now, after the read (a raise
            // before it could have let a newer holder delete the record).
            if !in_doubt.is_empty() {
                let hwm = self.hwm(partition).await?;
                if version < hwm {
                    return Err(stale(partition, version, hwm));
                }
            }
            let present = items
                .iter()
                .map(|item| get_n(item, "sk"))
                .collect::<StoreResult<BTreeSet<u64>>>()?;
            for seq in std::mem::take(&mut in_doubt) {
                if !present.contains(&seq) {
                    done.push(seq);
                }
            }
            // Per message: its last seq and the seqs to settle.
            let mut mine: BTreeMap<u64, (u64, Vec<u64>)> = BTreeMap::new();
            for item in &items {
                if opt_n::<u64>(item, "claim_version")? == Some(version) {
                    let entry = mine
                        .entry(get_n(item, "msg")?)
                        .or_insert((get_n(item, "msg_last")?, Vec::new()));
                    entry.1.push(get_n(item, "sk")?);
                }
            }
            wanted = mine.values().flat_map(|(_, s)| s.iter().copied()).collect();
            let mut groups = Vec::with_capacity(mine.len());
            for (msg, (msg_last, mut seqs)) in mine {
                seqs.sort_unstable();
                groups.push(match how {
                    Settle::Complete => {
                        self.completion(partition, version, msg, msg_last, seqs)
                            .await?
                    }
                    Settle::Release(release) => self.release_group(&rpk, version, seqs, release)?,
                });
            }
            for Group { seqs, actions } in self.transactions(&rpk, version, groups)? {
                match self.table.transact(actions).await? {
                    Ok(()) => {
                        for seq in &seqs {
                            wanted.remove(seq);
                        }
                        done.extend(seqs);
                    }
                    // The fence or a record changed, or a concurrent
                    // transaction was in the way: read again.
                    Err(codes) => {
                        if matches!(how, Settle::Complete) {
                            in_doubt.extend(seqs);
                        }
                        attempt += 1;
                        self.table
                            .pause(
                                attempt,
                                &format!("settling in {partition} was cancelled ({codes:?})"),
                            )
                            .await?;
                        continue 'read;
                    }
                }
            }
            break;
        }
        done.sort_unstable();
        Ok(done)
    }

    /// Packs `groups` into transactions, each starting with the fence check.
    fn transactions(&self, rpk: &str, version: u64, groups: Vec<Group>) -> StoreResult<Vec<Group>> {
        let fence = || -> StoreResult<Group> {
            let check = ConditionCheck::builder()
                .table_name(&self.table.name)
                .set_key(Some(key(rpk, HEAD)))
                .condition_expression("attribute_not_exists(hwm) OR hwm <= :v")
                .expression_attribute_values(":v", n(version))
                .build()
                .map_err(build_error)?;
            Ok(Group {
                seqs: Vec::new(),
                actions: vec![TransactWriteItem::builder().condition_check(check).build()],
            })
        };
        let mut out = Vec::new();
        let mut current = fence()?;
        for group in groups {
            if current.actions.len() + group.actions.len() > MAX_TRANSACTION {
                out.push(std::mem::replace(&mut current, fence()?));
            }
            current.seqs.extend(group.seqs);
            current.actions.extend(group.actions);
        }
        if !current.seqs.is_empty() {
            out.push(current);
        }
        Ok(out)
    }

    /// Deletes `seqs` of message `msg` (`msg..=msg_last`), and the message
    /// item when no other record of it is left (invariant 6).
    async fn completion(
        &self,
        partition: &str,
        version: u64,
        msg: u64,
        msg_last: u64,
        seqs: Vec<u64>,
    ) -> StoreResult<Group> {
        let rpk = records_pk(partition);
        let mut others = Vec::new();
        // Usually a message's records complete together: when `seqs` are
        // all of them, none can be left and there is nothing to read.
        let whole = u64::try_from(seqs.len()).is_ok_and(|len| msg + len == msg_last + 1);
        if !whole {
            self.table
                .query(&rpk, (msg, msg_last), PAGE, |item| {
                    let seq = get_n::<u64>(&item, "sk")?;
                    if seqs.binary_search(&seq).is_err() {
                        others.push(seq);
                    }
                    Ok(true)
                })
                .await?;
        }
        let mut actions = Vec::with_capacity(seqs.len() + others.len().max(1));
        for seq in &seqs {
            let delete = Delete::builder()
                .table_name(&self.table.name)
                .set_key(Some(key(&rpk, *seq)))
                .condition_expression("claim_version = :v")
                .expression_attribute_values(":v", n(version))
                .build()
                .map_err(build_error)?;
            actions.push(TransactWriteItem::builder().delete(delete).build());
        }
        if others.is_empty() {
            let delete = Delete::builder()
                .table_name(&self.table.name)
                .set_key(Some(key(&messages_pk(partition), msg)))
                .build()
                .map_err(build_error)?;
            actions.push(TransactWriteItem::builder().delete(delete).build());
        }
        for seq in others {
            let check = ConditionCheck::builder()
                .table_name(&self.table.name)
                .set_key(Some(key(&rpk, seq)))
                .condition_expression("attribute_exists(pk)")
                .build()
                .map_err(build_error)?;
            actions.push(TransactWriteItem::builder().condition_check(check).build());
        }
        Ok(Group { seqs, actions })
    }

    /// Makes `seqs` pending again, counting a failed send.
    fn release_group(
        &self,
        rpk: &str,
        version: u64,
        seqs: Vec<u64>,
        how: &Release,
    ) -> StoreResult<Group> {
        let mut actions = Vec::with_capacity(seqs.len());
        for seq in &seqs {
            let update = Update::builder()
                .table_name(&self.table.name)
                .set_key(Some(key(rpk, *seq)))
                .condition_expression("claim_version = :v")
                .expression_attribute_values(":v", n(version));
            let update = match how {
                Release::Untried => update.update_expression(UNCLAIM),
                Release::Failed {
                    error,
                    attempted_at,
                } => update
                    .update_expression(format!(
                        "SET replay_count = replay_count + :one, \
                         first_attempt_at = if_not_exists(first_attempt_at, :at), \
                         last_error = :error {UNCLAIM}"
                    ))
                    .expression_attribute_values(":one", n(1))
                    .expression_attribute_values(":at", n(unix_nanos(*attempted_at)?))
                    .expression_attribute_values(":error", s(error)),
            };
            actions.push(
                TransactWriteItem::builder()
                    .update(update.build().map_err(build_error)?)
                    .build(),
            );
        }
        Ok(Group { seqs, actions })
    }

    /// Every record of `partition` as stored, void claims pending.
    async fn records(&self, partition: &str) -> StoreResult<(u64, Vec<RawRecord>)> {
        let hwm = self.hwm(partition).await?;
        let (mut rows, mut names) = (Vec::new(), Names::default());
        self.table
            .query(&records_pk(partition), (HEAD + 1, LAST), PAGE, |item| {
                rows.push(raw(&item, hwm, &mut names)?);
                Ok(true)
            })
            .await?;
        Ok((hwm, rows))
    }

    /// Every record of `partition`, in seq order.
    #[cfg(test)]
    pub(crate) async fn dump(&self, partition: &str) -> StoreResult<Vec<OutboxRecord>> {
        let (_, rows) = self.records(partition).await?;
        self.with_envelopes(partition, rows).await
    }

    /// Message items stored for `partition`.
    #[cfg(test)]
    pub(crate) async fn envelopes(&self, partition: &str) -> StoreResult<usize> {
        let mut count = 0;
        self.table
            .query(&messages_pk(partition), (HEAD + 1, LAST), PAGE, |_| {
                count += 1;
                Ok(true)
            })
            .await?;
        Ok(count)
    }
}

impl OutboxStore for DynamoDbOutboxStore {
    fn append<'a>(
        &'a self,
        partition: &'a str,
        message: NewMessage,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(self.append_now(partition, message))
    }

    fn claim<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(async move {
            let stale_before = stale_before(now, self.options.stale_claim_duration)?;
            self.claiming(
                partition,
                owner,
                version,
                limit,
                now,
                Pick::Claim { stale_before },
            )
            .await
        })
    }

    fn complete<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(self.settle(partition, version, seqs, Settle::Complete))
    }

    fn release<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
        how: Release,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move {
            self.settle(partition, version, seqs, Settle::Release(&how))
                .await
        })
    }

    fn expire<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(self.claiming(partition, owner, version, limit, now, Pick::Expire))
    }

    fn stats<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<OutboxStats>> {
        Box::pin(async move {
            let (hwm, rows) = self.records(partition).await?;
            let mut stats = OutboxStats {
                high_water_mark: hwm,
                ..OutboxStats::default()
            };
            for row in rows {
                let claimed = row.claim_version.is_some();
                let created_at = from_unix_nanos(row.created_at)?;
                stats.total.add(claimed, created_at);
                stats
                    .bindings
                    .entry(row.binding.to_string())
                    .or_default()
                    .add(claimed, created_at);
            }
            Ok(stats)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use std::sync::atomic::{AtomicU32, Ordering};

    use aws_sdk_dynamodb::config::interceptors::BeforeDeserializationInterceptorContextMut;
    use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents, SharedInterceptor};
    use aws_smithy_runtime_api::client::orchestrator::Metadata;
    use ferry_tests::moto::Moto;

    use super::*;
    use crate::stores::NewRecord;
    use crate::stores::conformance::{STALE, dynamodb_outbox, dynamodb_table, envelope, t};
    use crate::stores::dynamodb::MAX_ITEM_BYTES;

    fn message(name: &str, bindings: usize) -> NewMessage {
        let records = (0..bindings)
            .map(|b| NewRecord::new(format!("b{b}"), "topic"))
            .collect();
        NewMessage::new(envelope(name), t(0), records)
    }

    /// Without `create_tables` a missing table is a startup error naming the
    /// fix; a table of another store's key schema is refused too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missing_or_foreign_table_is_refused_at_open() {
        let (client, options) = dynamodb_table("missing").await;
        let options = DynamoDbOptions {
            create_tables: false,
            ..options
        };
        let refused = DynamoDbOutboxStore::open_with(client.clone(), options).await;
        assert!(
            matches!(&refused, Err(StoreError::Invalid(m)) if m.contains("does not exist") && m.contains("create_tables")),
            "{:?}",
            refused.err()
        );

        let (client, options) = dynamodb_table("lease").await;
        crate::stores::dynamodb::DynamoDbLeaseStore::open_with(client.clone(), options.clone())
            .await
            .expect("a lease table");
        let refused = DynamoDbOutboxStore::open_with(client, options).await;
        assert!(
            matches!(&refused, Err(StoreError::Invalid(m)) if m.contains("key schema")),
            "{:?}",
            refused.err()
        );
    }

    /// An envelope beyond the item size limit and a fan-out beyond the
    /// transaction limit are refused before anything is written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_cannot_fit_is_refused_and_nothing_is_written() {
        let (store, _guard) = dynamodb_outbox().await;
        let mut big = message("big", 2);
        big.envelope.payload = vec![7; MAX_ITEM_BYTES].into();
        let refused = store.append("p", big).await;
        assert!(
            matches!(&refused, Err(StoreError::Invalid(m)) if m.starts_with("oversized")),
            "{refused:?}"
        );
        let wide = store
            .append("p", message("wide", MAX_TRANSACTION - 1))
            .await;
        assert!(matches!(wide, Err(StoreError::Invalid(_))), "{wide:?}");
        assert_eq!(store.stats("p").await.map(|s| s.total.depth), Ok(0));
        assert_eq!(store.envelopes("p").await, Ok(0));
        let widest = store
            .append("p", message("fits", MAX_TRANSACTION - 2))
            .await;
        assert_eq!(widest.map(|s| s.len()), Ok(MAX_TRANSACTION - 2));
    }

    /// Two agents appending to one partition at once: every append gets its
    /// own seqs, none twice, none skipped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_agents_appending_at_once_get_distinct_seqs() {
        let (first, _guard) = dynamodb_outbox().await;
        let second =
            DynamoDbOutboxStore::open_with(first.client().clone(), first.options().clone())
                .await
                .expect("open");
        let (first, second) = (Arc::new(first), Arc::new(second));
        let mut calls = Vec::new();
        for i in 0..20 {
            let store = Arc::clone(if i % 2 == 0 { &first } else { &second });
            calls.push(tokio::spawn(async move {
                store.append("p", message(&format!("m{i}"), 2)).await
            }));
        }
        let mut seqs = Vec::new();
        for call in calls {
            seqs.extend(call.await.expect("task").expect("append"));
        }
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=40).collect::<Vec<u64>>());
    }

    /// Two agents on one outbox: a claim at a higher version voids the older
    /// holder's claims, fences out its completions and releases, and the
    /// newer holder completes every record and with them every message.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_agent_takes_over_and_fences_the_first() {
        let (first, _guard) = dynamodb_outbox().await;
        let second =
            DynamoDbOutboxStore::open_with(first.client().clone(), first.options().clone())
                .await
                .expect("open");
        first.append("p", message("m", 2)).await.expect("append");
        assert_eq!(
            first.claim("p", "a", 1, 10, t(1)).await.map(|r| r.len()),
            Ok(2)
        );
        let theirs = second.claim("p", "b", 2, 10, t(2)).await.expect("claim");
        assert_eq!(theirs.len(), 2, "older claims are void");
        assert!(matches!(
            first.complete("p", 1, &[1, 2]).await,
            Err(StoreError::Stale(_))
        ));
        assert!(matches!(
            first.release("p", 1, &[1], Release::Untried).await,
            Err(StoreError::Stale(_))
        ));
        assert_eq!(second.complete("p", 2, &[1, 2]).await, Ok(vec![1, 2]));
        assert_eq!(first.envelopes("p").await, Ok(0));
    }

    /// Turns the answers of the next `lose` calls of `operation` into HTTP
    /// 500s after the service applied them: the SDK resends such a call,
    /// and gives up after its attempts. Other operations pass.
    #[derive(Debug)]
    struct LoseAnswers {
        operation: &'static str,
        lose: Arc<AtomicU32>,
    }

    impl Intercept for LoseAnswers {
        fn name(&self) -> &'static str {
            "LoseAnswers"
        }

        fn modify_before_deserialization(
            &self,
            context: &mut BeforeDeserializationInterceptorContextMut<'_>,
            _: &RuntimeComponents,
            cfg: &mut ConfigBag,
        ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let update = cfg
                .load::<Metadata>()
                .is_some_and(|m| m.name() == self.operation);
            let lost = update
                && self
                    .lose
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
            if lost {
                *context.response_mut().status_mut() = 500.try_into()?;
            }
            Ok(())
        }
    }

    /// A store whose client loses answers of `operation` on demand, on a
    /// fresh table, with `records` messages of one binding appended and the
    /// fence at 1.
    async fn losing_answers(
        operation: &'static str,
        records: usize,
    ) -> (DynamoDbOutboxStore, Arc<AtomicU32>) {
        let (client, options) = dynamodb_table("lost").await;
        let lose = Arc::new(AtomicU32::new(0));
        let client = aws_sdk_dynamodb::Client::from_conf(
            client
                .config()
                .to_builder()
                .interceptor(SharedInterceptor::new(LoseAnswers {
                    operation,
                    lose: Arc::clone(&lose),
                }))
                .build(),
        );
        let store = DynamoDbOutboxStore::open_with(client, options)
            .await
            .expect("open");
        for i in 0..records {
            store
                .append("p", message(&format!("m{i}"), 1))
                .await
                .expect("append");
        }
        // Raises the fence, so that every update of the claims below is a
        // record's.
        assert_eq!(store.claim("p", "o", 1, 0, t(1)).await, Ok(Vec::new()));
        (store, lose)
    }

    fn seqs(records: &[OutboxRecord]) -> Vec<u64> {
        records.iter().map(|r| r.seq).collect()
    }

    /// A claim's update applied, its answer lost, the SDK resends it: the
    /// resent update finds the record claimed by its own call and returns
    /// it (invariant 4), instead of leaving it claimed and unreturned.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resent_claim_update_returns_its_record() {
        let (store, lose) = losing_answers("UpdateItem", 3).await;
        lose.store(1, Ordering::SeqCst);
        let claimed = store.claim("p", "o", 1, 10, t(2)).await.expect("claim");
        assert_eq!(lose.load(Ordering::SeqCst), 0, "an answer was lost");
        assert_eq!(seqs(&claimed), vec![1, 2, 3]);
    }

    /// Every answer of a claim lost until the SDK gives up: the call fails,
    /// its records are claimed in the table, and the same owner's next
    /// claim returns them at once, in order (invariant 7) — not after
    /// `stale_claim_duration`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_claim_owes_its_records_to_the_next() {
        let (store, lose) = losing_answers("UpdateItem", 3).await;
        lose.store(u32::MAX, Ordering::SeqCst);
        let failed = store.claim("p", "o", 1, 10, t(2)).await;
        assert!(failed.is_err_and(|e| !e.outcome_known()));
        lose.store(0, Ordering::SeqCst);
        let stats = store.stats("p").await.expect("stats");
        assert_eq!(stats.total.claimed, 3, "the lost updates applied");
        // Still well within the stale claim duration.
        let claimed = store.claim("p", "o", 1, 10, t(3)).await.expect("claim");
        assert_eq!(seqs(&claimed), vec![1, 2, 3]);
        assert_eq!(store.complete("p", 1, &[1, 2, 3]).await, Ok(vec![1, 2, 3]));
    }

    /// What a failed claim owes and another call of the same owner won in
    /// the meantime (here a second store instance whose claim found the
    /// failed call's claims stale) is not returned again: the owed claim
    /// accepts only the failed call's own token (invariant 7).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_owed_record_won_by_another_call_is_not_returned_twice() {
        let (store, lose) = losing_answers("UpdateItem", 2).await;
        lose.store(u32::MAX, Ordering::SeqCst);
        assert!(store.claim("p", "o", 1, 10, t(2)).await.is_err());
        lose.store(0, Ordering::SeqCst);
        let other = DynamoDbOutboxStore::open_with(store.client().clone(), store.options().clone())
            .await
            .expect("open");
        let later = t(2) + STALE * 2;
        let won = other.claim("p", "o", 1, 10, later).await.expect("claim");
        assert_eq!(seqs(&won), vec![1, 2]);
        let again = store.claim("p", "o", 1, 10, t(3)).await.expect("claim");
        assert_eq!(seqs(&again), Vec::<u64>::new(), "returned twice");
    }

    /// A claim returns at most `limit` of what is owed; the rest comes with
    /// the next one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn owed_records_come_back_at_most_limit_at_a_time() {
        let (store, lose) = losing_answers("UpdateItem", 3).await;
        lose.store(u32::MAX, Ordering::SeqCst);
        assert!(store.claim("p", "o", 1, 10, t(2)).await.is_err());
        lose.store(0, Ordering::SeqCst);
        let first = store.claim("p", "o", 1, 2, t(3)).await.expect("claim");
        assert_eq!(seqs(&first), vec![1, 2]);
        let rest = store.claim("p", "o", 1, 2, t(3)).await.expect("claim");
        assert_eq!(seqs(&rest), vec![3]);
    }

    /// A completion applied, its answer lost, the SDK resends it and the
    /// resend is cancelled (the records are gone; moto, unlike DynamoDB,
    /// ignores the idempotency token): the call still reports the records
    /// it deleted (invariant 5), so that the drainer counts them as sent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resent_completion_reports_what_it_deleted() {
        let (store, lose) = losing_answers("TransactWriteItems", 3).await;
        let claimed = store.claim("p", "o", 1, 10, t(2)).await.expect("claim");
        assert_eq!(seqs(&claimed), vec![1, 2, 3]);
        lose.store(1, Ordering::SeqCst);
        assert_eq!(store.complete("p", 1, &[1, 2, 3]).await, Ok(vec![1, 2, 3]));
        assert_eq!(lose.load(Ordering::SeqCst), 0, "an answer was lost");
        assert_eq!(store.stats("p").await.map(|s| s.total.depth), Ok(0));
        assert_eq!(store.envelopes("p").await, Ok(0));
    }

    /// An append applied, its answer lost, the SDK resends it and the
    /// resend fails its condition (the counter moved): the append finds its
    /// own records and reports their seqs instead of appending the message
    /// a second time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resent_append_is_stored_once() {
        let (store, lose) = losing_answers("TransactWriteItems", 0).await;
        lose.store(1, Ordering::SeqCst);
        assert_eq!(store.append("p", message("m", 2)).await, Ok(vec![1, 2]));
        assert_eq!(lose.load(Ordering::SeqCst), 0, "an answer was lost");
        assert_eq!(store.stats("p").await.map(|s| s.total.depth), Ok(2));
        assert_eq!(store.envelopes("p").await, Ok(1));
        assert_eq!(store.append("p", message("n", 1)).await, Ok(vec![3]));
    }

    /// The service unreachable: appends and claims fail with an unknown
    /// outcome (the source stays unacknowledged, the records claimed), not
    /// a panic, and the store works again once the service is back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_service_is_an_unknown_outcome() {
        let mut moto = Moto::start_private().await.expect("moto");
        let (_, options) = dynamodb_table("outage").await;
        let store = DynamoDbOutboxStore::open_with(moto.dynamodb(), options)
            .await
            .expect("open");
        assert_eq!(store.append("p", message("before", 1)).await, Ok(vec![1]));
        moto.kill().expect("kill");
        let refused = store.append("p", message("during", 1)).await;
        assert!(
            refused.as_ref().is_err_and(|e| !e.outcome_known()),
            "{refused:?}"
        );
        let claim = store.claim("p", "o", 1, 10, t(1)).await;
        assert!(claim.is_err_and(|e| !e.outcome_known()));
        // moto restarts empty: what matters is that the store answers again.
        moto.restart().await.expect("restart");
        let reopened = DynamoDbOutboxStore::open_with(moto.dynamodb(), store.options().clone())
            .await
            .expect("reopen");
        assert_eq!(reopened.append("p", message("after", 1)).await, Ok(vec![1]));
    }
}
