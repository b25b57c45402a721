//! The MQTT event loop: one per session, the only owner of its socket.
//!
//! Invariants:
//!
//! - **One write per turn.** Each turn takes *everything* the [`Client`]'s
//!   queues hold — control requests (acknowledgements, subscriptions, the
//!   disconnect) first, then publishes while the outgoing window has room —
//!   up to [`BATCH_BYTES`], together with the packets the loop owes the broker
//!   (PUBREL, PUBCOMP, PINGREQ), encodes them into one buffer and writes it
//!   with one call (more only when the kernel takes part of it). Then it reads
//!   what the broker sent before it takes requests again, so a steady stream
//!   of requests cannot starve the reads (what has reached the low-water mark,
//!   below).
//! - **Answers are read in batches.** On plain TCP the socket's receive
//!   low-water mark follows the answers the broker owes, set again before
//!   every wait to read ([`LowWater`], ADR 0019): a sending session wakes
//!   once an eighth to a quarter of them arrived, not for each PUBACK, and
//!   is never left waiting for bytes no one owes it (a broker's DISCONNECT
//!   not followed by its close waits with the answers). A receiving session
//!   reads every packet as it comes.
//! - **Written means written.** `PublishWritten` is reported after the bytes
//!   of that publish left in a write, in request order (the senders' FIFO of
//!   waiters relies on it); so a publish is reported written before its
//!   PUBACK can be read. `Acked` is reported only for a packet id in flight on
//!   this connection.
//! - **Packet ids.** A QoS 1/2 publish gets an id that is not in flight on
//!   this connection, cycling through `1..=window`, where the window is
//!   `max_outgoing_inflight` capped by the broker's receive maximum. With the
//!   window full, publishes wait in the queue: an id is never reused before
//!   its PUBACK (or PUBCOMP).
//! - **A connection's state dies with it.** Unacknowledged publishes are not
//!   resent with DUP on the next connection: the session fails their senders
//!   and the outbox sends them again, in its own order; resending them here
//!   too would send each twice. A broker holds no state for a QoS 1 publish it
//!   has not acknowledged, so nothing is owed to it. The one exception is
//!   QoS 2: a publish the broker has PUBREC'd holds its packet id in the
//!   broker's session until PUBREL, so those ids are kept across connections
//!   ([`EventLoop::pubrel_owed`]) and released again on a resumed session
//!   (MQTT v5 §4.4) before anything reuses them.
//! - **A connection's end is reported last.** Packets decoded in the read
//!   that ended it are reported before the error ([`EventLoop::poll`]), while
//!   the session still counts them as that connection's; a connection that
//!   ends before it was reported connected reports nothing.
//! - **Keep-alive.** A PINGREQ goes out when nothing was written for the
//!   keep-alive interval (the broker's server keep-alive when it sets one); a
//!   PINGRESP missing one interval later ends the connection.
//! - **A burst waits in the broker, as far as it can.** While the receiver
//!   holds reads ([`Client::hold_reads`]: more than a receive window waits
//!   behind its full delivery channel) the loop does not read — the rest of
//!   a burst the broker sends past the receive window stays in the broker
//!   and the socket — *unless it awaits an answer*: a PUBACK, PUBREC or
//!   PUBCOMP of its publishes, a SUBACK or a PINGRESP. So a session that also
//!   sends never waits for an acknowledgement behind publishes it does not
//!   read, and the keep-alive still sees its PINGRESP. The price: the answer
//!   comes behind everything the broker queued, so such a read takes the
//!   burst into the receiver's overflow as before (a session with QoS 1/2
//!   sends in flight, or a route stalled for a keep-alive interval, holds
//!   little back); and while reads are held a broker's DISCONNECT or a
//!   closed socket is noticed at the next write or PINGREQ, not at once.
//! - **Cancel safety.** `poll` may be dropped at any await (the session stops):
//!   the partial read and the unwritten rest of a write live in the
//!   connection, never in a future.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use prost::bytes::{Buf, BytesMut};
use rumqttc::tokio_rustls::TlsConnector;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::time::Instant;

use super::codec::{Codec, ConnectOptions, Incoming};
use super::low_water::LowWater;
use super::packet_ids::PacketIdMap;
use super::protocol::{Client, Control, Event};
use super::settings::{
    Endpoint, MQTT_MAX_PACKET_BYTES, MqttReceiverSettings, MqttSessionSettings, Protocol, Qos,
    SettingsError,
};
use super::tls;
use crate::transports::SendError;

/// A turn stops taking requests once its buffer holds this much.
const BATCH_BYTES: usize = 64 * 1024;
/// Room made in the read buffer before each read: a full `BytesMut` would
/// otherwise grow by a few bytes per read, one system call each.
const READ_ROOM: usize = 32 * 1024;

trait Stream: AsyncRead + AsyncWrite + Unpin + Send + Sync {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync> Stream for T {}

/// What an id in flight waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pending {
    /// PUBACK (QoS 1) or PUBREC (QoS 2) of our publish.
    Publish(Qos),
    /// PUBCOMP of our QoS 2 publish, after our PUBREL.
    Complete,
    /// SUBACK.
    Subscribe,
}

/// The packet ids in flight on one connection.
#[derive(Debug)]
struct Inflight {
    pending: PacketIdMap<Pending>,
    /// How many publishes may be in flight at once.
    window: u16,
    last: u16,
}

impl Inflight {
    fn new(window: u16) -> Self {
        Self {
            pending: PacketIdMap::default(),
            window: window.max(1),
            last: 0,
        }
    }

    /// A free id in `1..=limit`, or `None` when `limit` ids are taken.
    fn allocate(&mut self, what: Pending, limit: u16) -> Option<u16> {
        if self.pending.len() >= usize::from(limit) {
            return None;
        }
        // Terminates: fewer than `limit` ids are taken, so one in 1..=limit is free.
        loop {
            self.last = if self.last >= limit { 1 } else { self.last + 1 };
            if let std::collections::hash_map::Entry::Vacant(entry) = self.pending.entry(self.last)
            {
                entry.insert(what);
                return Some(self.last);
            }
        }
    }
}

/// One connection: its socket, buffers and ids in flight.
struct Connection {
    stream: Box<dyn Stream>,
    read: BytesMut,
    /// Encoded, not yet written.
    write: BytesMut,
    /// What to report once `write` is written.
    written: Vec<Event>,
    inflight: Inflight,
    /// The largest packet we may write (ours, capped by the broker's).
    max_outgoing: u32,
    keep_alive: Option<Duration>,
    last_write: Instant,
    ping_sent: Option<Instant>,
    /// The last write was followed by no read yet.
    read_due: bool,
    /// Our DISCONNECT is in `write` (or written): take no more requests.
    closing: bool,
    /// The socket's receive low-water mark, following the answers owed.
    low_water: LowWater,
}

impl Connection {
    /// Whether the broker owes this connection an answer: to a publish, a
    /// subscription or a PINGREQ.
    fn awaits_answer(&self) -> bool {
        !self.inflight.pending.is_empty() || self.ping_sent.is_some()
    }

    /// Whether to read: unless the receiver holds reads and nothing is
    /// awaited (see the module's invariants).
    fn may_read(&self, client: &Client) -> bool {
        !client.reads_held() || self.awaits_answer()
    }

    /// When to send a PINGREQ, or to give up on the PINGRESP.
    fn keep_alive_deadline(&self) -> Option<Instant> {
        let interval = self.keep_alive?;
        Some(self.ping_sent.unwrap_or(self.last_write) + interval)
    }
}

/// Why a turn stopped waiting.
enum Woke {
    Read,
    Requested,
    KeepAlive,
}

/// Connects, and runs one connection at a time; see the module invariants.
pub(crate) struct EventLoop {
    client: Client,
    codec: Codec,
    endpoint: Endpoint,
    tls: Option<TlsConnector>,
    options: ConnectOptions,
    connect_timeout: Duration,
    max_outgoing_inflight: u16,
    max_outgoing: u32,
    connection: Option<Connection>,
    events: VecDeque<Event>,
    /// Why the connection ended, reported once the events decoded before
    /// the end are (see [`EventLoop::poll`]).
    failed: Option<String>,
    /// Our QoS 2 publishes the broker PUBREC'd and has not PUBCOMP'd: the
    /// broker's session holds their ids until our PUBREL, on this connection
    /// or the next resumed one.
    pubrel_owed: BTreeSet<u16>,
    /// The session has a receiver: the broker sends it publishes.
    receives: bool,
}

/// Builds the client and its event loop for a session; nothing connects yet.
pub(crate) fn create(
    settings: &MqttSessionSettings,
    endpoint: &Endpoint,
    receiver: Option<&MqttReceiverSettings>,
) -> Result<(Client, EventLoop), SettingsError> {
    let tls = if endpoint.tls() {
        Some(TlsConnector::from(tls::client_config(
            settings.ca_file.as_deref(),
        )?))
    } else {
        None
    };
    // A receiving session accepts any packet the broker may send: announcing
    // a smaller maximum makes the broker discard larger messages silently
    // (MQTT v5 §3.1.2.11.4), and a smaller incoming limit would drop the
    // connection on one and get it redelivered forever. A message too large
    // for the route is dead-lettered as `oversized` by the route instead.
    let max_incoming = if receiver.is_some() {
        MQTT_MAX_PACKET_BYTES
    } else {
        settings.max_packet_bytes
    };
    let options = ConnectOptions {
        client_id: settings.client_id.clone(),
        // Validated: whole seconds in 5..=65535.
        keep_alive_secs: u16::try_from(settings.keep_alive.as_secs()).unwrap_or(u16::MAX),
        clean_start: settings.clean_start,
        session_expiry_secs: u32::try_from(settings.session_expiry.as_secs()).unwrap_or(u32::MAX),
        credentials: settings.username.clone().map(|u| {
            let password = settings.password.as_ref().map(|p| p.expose().to_owned());
            (u, password.unwrap_or_default())
        }),
        receive_maximum: receiver.map(|r| r.max_in_flight),
        max_incoming,
    };
    let client = Client::default();
    let eventloop = EventLoop {
        client: client.clone(),
        codec: match settings.protocol {
            Protocol::V5 => Codec::V5,
            Protocol::V311 => Codec::V311,
        },
        endpoint: endpoint.clone(),
        tls,
        options,
        connect_timeout: settings.connect_timeout,
        max_outgoing_inflight: settings.max_outgoing_inflight,
        max_outgoing: settings.max_packet_bytes,
        connection: None,
        events: VecDeque::new(),
        failed: None,
        pubrel_owed: BTreeSet::new(),
        receives: receiver.is_some(),
    };
    Ok((client, eventloop))
}

impl EventLoop {
    /// The next event; an error means the connection is gone (the next poll
    /// connects again). What was decoded before a connection ended is
    /// reported before its end: a publish received on it is handled while
    /// its acknowledgement still belongs to that connection (after the end,
    /// the receiver would queue it for the next connection, under a packet
    /// id the broker may have given to another message), and a PUBACK read
    /// before it still resolves its send.
    pub async fn poll(&mut self) -> Result<Event, String> {
        loop {
            if let Some(event) = self.events.pop_front() {
                return Ok(event);
            }
            if let Some(error) = self.failed.take() {
                return Err(error);
            }
            if self.connection.is_none() {
                return self.connect().await;
            }
            if let Err(error) = self.turn().await {
                self.connection = None;
                self.failed = Some(error);
            }
        }
    }

    /// An event already decoded, if any; never waits, reads or writes (the
    /// session handles every ready event before it flushes and wakes once).
    pub fn ready(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// After a connection loss: drops the requests still queued (see
    /// [`Client::discard_unsent`]).
    pub fn discard_unsent(&self) {
        self.client.discard_unsent();
    }

    async fn connect(&mut self) -> Result<Event, String> {
        let connecting = tokio::time::timeout(self.connect_timeout, self.handshake());
        let (stream, read, connack, low_water) = match connecting.await {
            Ok(result) => result?,
            Err(_) => {
                return Err(format!(
                    "no CONNACK within the connect timeout of {:?}",
                    self.connect_timeout
                ));
            }
        };
        if let Some(refused) = connack.refused {
            return Err(format!("the broker refused the connection: {refused}"));
        }
        let window = connack
            .receive_maximum
            .map_or(self.max_outgoing_inflight, |r| {
                r.min(self.max_outgoing_inflight)
            });
        let max_outgoing = connack
            .max_packet_size
            .map_or(self.max_outgoing, |b| b.min(self.max_outgoing));
        let keep_alive = match connack.server_keep_alive {
            Some(0) => None,
            Some(secs) => Some(Duration::from_secs(u64::from(secs))),
            None => Some(Duration::from_secs(u64::from(self.options.keep_alive_secs))),
        };
        let mut connection = Connection {
            stream,
            read,
            write: BytesMut::with_capacity(BATCH_BYTES),
            written: Vec::new(),
            inflight: Inflight::new(window),
            max_outgoing,
            keep_alive,
            last_write: Instant::now(),
            ping_sent: None,
            read_due: false,
            closing: false,
            low_water,
        };
        if connack.session_present {
            for &pkid in &self.pubrel_owed {
                connection.inflight.pending.insert(pkid, Pending::Complete);
                self.codec
                    .pubrel(pkid, &mut connection.write)
                    .map_err(|e| e.0)?;
            }
        } else {
            self.pubrel_owed.clear();
        }
        self.connection = Some(connection);
        // The broker may have sent more right behind the CONNACK. A
        // connection that fails to decode it is gone before it was reported
        // connected: nothing of it is reported (a publish on it comes again).
        if let Err(error) = self.decode_all() {
            self.connection = None;
            self.events.clear();
            return Err(error);
        }
        Ok(Event::Connected {
            session_present: connack.session_present,
            max_packet_size: connack.max_packet_size,
        })
    }

    /// TCP (and TLS) or the Unix socket, CONNECT, and the CONNACK with
    /// whatever arrived after it; the connection's low-water mark.
    async fn handshake(
        &self,
    ) -> Result<(Box<dyn Stream>, BytesMut, super::codec::ConnAck, LowWater), String> {
        let io = |e: std::io::Error| format!("I/O: {e}");
        let (mut stream, low_water): (Box<dyn Stream>, _) = match &self.endpoint {
            // A Unix socket wakes its reader for any byte whatever the mark
            // (its poll ignores SO_RCVLOWAT), so it reads as packets come.
            Endpoint::Unix(path) => {
                let unix = UnixStream::connect(path)
                    .await
                    .map_err(|e| format!("I/O: {}: {e}", path.display()))?;
                (Box::new(unix), LowWater::none())
            }
            Endpoint::Tcp { host, port, .. } => {
                let tcp = TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(io)?;
                tcp.set_nodelay(true).map_err(io)?;
                match &self.tls {
                    Some(connector) => {
                        let name = ServerName::try_from(host.clone())
                            .map_err(|e| format!("TLS: invalid server name: {e}"))?;
                        let tls = connector
                            .connect(name, tcp)
                            .await
                            .map_err(|e| format!("TLS: {e}"))?;
                        (Box::new(tls), LowWater::none())
                    }
                    // A receiving session reads as packets come (low_water,
                    // invariant 2).
                    None if self.receives => (Box::new(tcp), LowWater::none()),
                    None => {
                        let low_water = LowWater::of(&tcp, &self.options.client_id);
                        (Box::new(tcp), low_water)
                    }
                }
            }
        };
        let mut write = BytesMut::new();
        self.codec
            .connect(&self.options, &mut write)
            .map_err(|e| e.0)?;
        stream.write_all(&write).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        let mut read = BytesMut::new();
        loop {
            match self.codec.decode(&mut read, self.options.max_incoming)? {
                Some(Incoming::ConnAck(connack)) => {
                    return Ok((stream, read, connack, low_water));
                }
                Some(other) => {
                    return Err(format!(
                        "the broker sent {other:?} before its CONNACK (a protocol error)"
                    ));
                }
                None => {}
            }
            read.reserve(READ_ROOM);
            if stream.read_buf(&mut read).await.map_err(io)? == 0 {
                return Err("the broker closed the connection before its CONNACK".into());
            }
        }
    }

    /// One turn on the connection: write what is queued, or wait for input,
    /// a request or the keep-alive.
    async fn turn(&mut self) -> Result<(), String> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(());
        };
        // Reads are owed after a write, unless they are held: then the
        // loop writes on.
        if (!connection.read_due || !connection.may_read(&self.client)) && !connection.closing {
            take_requests(&self.client, self.codec, connection, &mut self.events)?;
            if connection.write.is_empty() && !self.events.is_empty() {
                // Only publishes refused for their size: report them now,
                // not after the next read.
                return Ok(());
            }
        }
        if !connection.write.is_empty() {
            write_out(connection).await?;
            connection.last_write = Instant::now();
            connection.read_due = true;
            self.events.extend(connection.written.drain(..));
            if connection.closing {
                self.events.push_back(Event::DisconnectSent);
            }
            return Ok(());
        }
        if connection.closing {
            connection.stream.shutdown().await.ok();
            return Err("disconnected by the client".into());
        }
        connection.read_due = false;
        connection.read.reserve(READ_ROOM);
        let read = connection.may_read(&self.client);
        // A PINGRESP is 2 bytes: awaited with the mark at 1.
        let owed = match connection.ping_sent {
            Some(_) => 0,
            None => connection.inflight.pending.len(),
        };
        connection
            .low_water
            .follow(owed)
            .map_err(|e| format!("I/O: cannot set the receive low-water mark: {e}"))?;
        let deadline = connection.keep_alive_deadline();
        let keep_alive = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let woke = tokio::select! {
            biased;
            read = connection.stream.read_buf(&mut connection.read), if read => match read {
                Ok(0) => return Err("the broker closed the connection".into()),
                Ok(_) => Woke::Read,
                Err(e) => return Err(format!("I/O: {e}")),
            },
            () = self.client.requested() => Woke::Requested,
            () = keep_alive => Woke::KeepAlive,
        };
        match woke {
            Woke::Read => self.decode_all(),
            Woke::Requested => Ok(()),
            Woke::KeepAlive => {
                if connection.ping_sent.is_some() {
                    return Err("no PINGRESP within the keep-alive interval".into());
                }
                connection.ping_sent = Some(Instant::now());
                self.codec.pingreq(&mut connection.write).map_err(|e| e.0)
            }
        }
    }

    /// Handles every whole packet read so far.
    fn decode_all(&mut self) -> Result<(), String> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(());
        };
        while let Some(incoming) = self
            .codec
            .decode(&mut connection.read, self.options.max_incoming)?
        {
            on_incoming(
                self.codec,
                connection,
                &mut self.pubrel_owed,
                &mut self.events,
                incoming,
            )?;
        }
        Ok(())
    }
}

/// Moves queued requests into the connection's write buffer (see the module
/// invariants for the order and the bounds).
fn take_requests(
    client: &Client,
    codec: Codec,
    connection: &mut Connection,
    events: &mut VecDeque<Event>,
) -> Result<(), String> {
    let mut requests = client.lock();
    while connection.write.len() < BATCH_BYTES {
        let Some(control) = requests.control.pop_front() else {
            break;
        };
        match control {
            Control::Ack { pkid, qos } => codec.ack(pkid, qos, &mut connection.write),
            Control::Subscribe(filters) => {
                match connection.inflight.allocate(Pending::Subscribe, u16::MAX) {
                    Some(pkid) => codec.subscribe(pkid, &filters, &mut connection.write),
                    None => {
                        requests.control.push_front(Control::Subscribe(filters));
                        break;
                    }
                }
            }
            Control::Disconnect => {
                connection.closing = true;
                return codec.disconnect(&mut connection.write).map_err(|e| e.0);
            }
        }
        .map_err(|e| e.0)?;
    }
    let window = connection.inflight.window;
    let max = connection.max_outgoing as usize;
    while connection.write.len() < BATCH_BYTES {
        let Some(front) = requests.publishes.front() else {
            break;
        };
        let (qos, size) = (front.qos, front.len());
        let pkid = if size > max || qos == Qos::AtMostOnce {
            0
        } else {
            match connection.inflight.allocate(Pending::Publish(qos), window) {
                Some(pkid) => pkid,
                None => break,
            }
        };
        let Some(publish) = requests.publishes.pop_front() else {
            break;
        };
        if size > max {
            // Reported in order with the publishes written before it.
            connection
                .written
                .push(Event::PublishFailed(SendError::Oversized(format!(
                    "a publish of {size} bytes exceeds the maximum packet size of {max} bytes"
                ))));
            continue;
        }
        publish.write(pkid, &mut connection.write);
        connection.written.push(Event::PublishWritten(pkid));
    }
    drop(requests);
    if connection.write.is_empty() && !connection.written.is_empty() {
        // Only failures: nothing to write, report them now.
        events.extend(connection.written.drain(..));
    }
    Ok(())
}

/// Writes the whole buffer; cancel-safe (what is written leaves the buffer).
async fn write_out(connection: &mut Connection) -> Result<(), String> {
    while !connection.write.is_empty() {
        let n = connection
            .stream
            .write(&connection.write)
            .await
            .map_err(|e| format!("I/O: {e}"))?;
        if n == 0 {
            return Err("I/O: the connection takes no more bytes".into());
        }
        connection.write.advance(n);
    }
    connection
        .stream
        .flush()
        .await
        .map_err(|e| format!("I/O: {e}"))
}

fn on_incoming(
    codec: Codec,
    connection: &mut Connection,
    pubrel_owed: &mut BTreeSet<u16>,
    events: &mut VecDeque<Event>,
    incoming: Incoming,
) -> Result<(), String> {
    let pending = &mut connection.inflight.pending;
    match incoming {
        Incoming::Publish(received) => events.push_back(Event::Publish(received)),
        Incoming::PubAck { pkid, refused } => {
            if pending.get(&pkid) == Some(&Pending::Publish(Qos::AtLeastOnce)) {
                pending.remove(&pkid);
                events.push_back(Event::Acked { pkid, refused });
            } else {
                tracing::warn!(pkid, "a PUBACK for no publish in flight; ignored");
            }
        }
        Incoming::PubRec { pkid, refused } => {
            if pending.get(&pkid) != Some(&Pending::Publish(Qos::ExactlyOnce)) {
                tracing::warn!(pkid, "a PUBREC for no publish in flight; ignored");
            } else if refused.is_some() {
                // A refused QoS 2 publish ends at its PUBREC (v5 §4.3.3).
                pending.remove(&pkid);
                events.push_back(Event::Acked { pkid, refused });
            } else {
                pending.insert(pkid, Pending::Complete);
                pubrel_owed.insert(pkid);
                codec.pubrel(pkid, &mut connection.write).map_err(|e| e.0)?;
            }
        }
        Incoming::PubComp { pkid } => {
            if pending.get(&pkid) == Some(&Pending::Complete) {
                pending.remove(&pkid);
                pubrel_owed.remove(&pkid);
                // Reported also for a PUBREL resent on a resumed session: its
                // sender was failed with the connection that PUBREC'd it, so
                // the session finds no one waiting on the id and ignores it.
                events.push_back(Event::Acked {
                    pkid,
                    refused: None,
                });
            } else {
                tracing::warn!(pkid, "a PUBCOMP for no publish in flight; ignored");
            }
        }
        Incoming::PubRel { pkid } => {
            codec
                .pubcomp(pkid, &mut connection.write)
                .map_err(|e| e.0)?;
        }
        Incoming::SubAck { pkid, refused } => {
            if pending.remove(&pkid) == Some(Pending::Subscribe) {
                events.push_back(Event::Subscribed { refused });
            } else {
                tracing::warn!(pkid, "a SUBACK for no subscription in flight; ignored");
            }
        }
        Incoming::PingResp => connection.ping_sent = None,
        Incoming::Disconnect(reason) => {
            return Err(format!("the broker disconnected: {reason}"));
        }
        Incoming::ConnAck(_) => {
            return Err("the broker sent a second CONNACK (a protocol error)".into());
        }
        Incoming::Unexpected(what) => {
            return Err(format!(
                "the broker sent a {what} packet, which only a client sends (a protocol error)"
            ));
        }
    }
    Ok(())
}

/// A test broker's CONNACK (v5), with its receive maximum and its keep-alive
/// if given.
#[cfg(test)]
pub(super) fn test_connack(
    receive_max: Option<u16>,
    keep_alive: Option<u16>,
) -> rumqttc::v5::mqttbytes::v5::Packet {
    use rumqttc::v5::mqttbytes::v5::{ConnAck, ConnAckProperties, ConnectReturnCode, Packet};
    let properties = (receive_max.is_some() || keep_alive.is_some()).then(|| ConnAckProperties {
        session_expiry_interval: None,
        receive_max,
        max_qos: None,
        retain_available: None,
        max_packet_size: None,
        assigned_client_identifier: None,
        topic_alias_max: None,
        reason_string: None,
        user_properties: Vec::new(),
        wildcard_subscription_available: None,
        subscription_identifiers_available: None,
        shared_subscription_available: None,
        server_keep_alive: keep_alive,
        response_information: None,
        server_reference: None,
        authentication_method: None,
        authentication_data: None,
    });
    Packet::ConnAck(ConnAck {
        session_present: false,
        code: ConnectReturnCode::Success,
        properties,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::SystemTime;

    use prost::bytes::Bytes;
    use rumqttc::v5::mqttbytes::v5::Packet;
    use tokio::net::TcpListener;

    use super::*;
    use crate::transports::mqtt::publish::Publish;

    /// A connection whose socket is never used: `take_requests` only encodes.
    fn connection(max_outgoing: u32, window: u16) -> Connection {
        let (ours, _theirs) = tokio::io::duplex(64);
        Connection {
            stream: Box::new(ours),
            read: BytesMut::new(),
            write: BytesMut::new(),
            written: Vec::new(),
            inflight: Inflight::new(window),
            max_outgoing,
            keep_alive: None,
            last_write: Instant::now(),
            ping_sent: None,
            read_due: false,
            closing: false,
            low_water: LowWater::none(),
        }
    }

    /// The senders match "written" and "failed" events to their waiters in
    /// request order, so a publish refused for its size is reported in its
    /// place, and it takes no packet id.
    #[test]
    fn refused_publishes_are_reported_in_order_and_take_no_packet_id() {
        let client = Client::default();
        let small = crate::stores::conformance::envelope("a");
        let now = SystemTime::now();
        let size = |e| Publish::v5("t", Qos::AtLeastOnce, false, e, now).map(|p| p.len());
        let max = size(&small).expect("valid") + 10;
        let mut big = small.clone();
        big.payload = Bytes::from(vec![0; max]);
        for (qos, e) in [
            (Qos::AtLeastOnce, &small),
            (Qos::AtLeastOnce, &big),
            (Qos::AtMostOnce, &small),
            (Qos::AtMostOnce, &big),
            (Qos::ExactlyOnce, &small),
        ] {
            let publish = Publish::v5("t", qos, false, e, now).expect("valid");
            assert!(client.try_publish(publish).is_ok());
        }
        let mut c = connection(u32::try_from(max).expect("small"), 10);
        let mut events = VecDeque::new();
        assert!(take_requests(&client, Codec::V5, &mut c, &mut events).is_ok());
        let written: Vec<String> = c
            .written
            .iter()
            .map(|e| match e {
                Event::PublishWritten(pkid) => format!("written {pkid}"),
                Event::PublishFailed(SendError::Oversized(_)) => "oversized".into(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(
            written,
            [
                "written 1",
                "oversized",
                "written 0",
                "oversized",
                "written 2"
            ]
        );
        assert_eq!(c.inflight.pending.len(), 2, "ids 1 and 2 only");
        assert!(events.is_empty(), "reported once written");
        // The buffer holds the three publishes, in order.
        let mut ids = Vec::new();
        while let Ok(Some(Incoming::Publish(p))) = Codec::V5.decode(&mut c.write, u32::MAX) {
            ids.push(p.pkid);
        }
        assert_eq!((ids, c.write.len()), (vec![1, 0, 2], 0));
    }

    /// What a test broker writes: each inner list in one write.
    type Writes = Vec<Vec<Packet>>;

    /// A broker on a free port: it reads the client's packets and writes
    /// what `answer` returns for each (the CONNECT too), 50 ms apart, noting
    /// when it began each write; the socket stays open until the client
    /// closes it or the test ends.
    async fn broker(
        mut answer: impl FnMut(Packet) -> Writes + Send + 'static,
    ) -> (u16, Arc<Mutex<Vec<Instant>>>, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let port = listener.local_addr().expect("bound").port();
        let written = Arc::new(Mutex::new(Vec::new()));
        let times = Arc::clone(&written);
        let task = tokio::spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let mut read = BytesMut::new();
            while socket.read_buf(&mut read).await.is_ok_and(|n| n > 0) {
                while let Ok(packet) = Packet::read(&mut read, None) {
                    for packets in answer(packet) {
                        let mut out = BytesMut::new();
                        for packet in &packets {
                            packet.write(&mut out, None).expect("encodable");
                        }
                        times.lock().expect("unpoisoned").push(Instant::now());
                        let _ = socket.write_all(&out).await;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        (port, written, task)
    }

    /// A broker that answers the CONNECT with `writes` and nothing else.
    async fn fake_broker(writes: Writes) -> (u16, tokio::task::JoinHandle<()>) {
        let mut writes = Some(writes);
        let (port, _, task) = broker(move |packet| match packet {
            Packet::Connect(..) => writes.take().unwrap_or_default(),
            _ => Vec::new(),
        })
        .await;
        (port, task)
    }

    /// The broker's publish with packet id 9.
    fn publish_9() -> Packet {
        let mut publish = rumqttc::v5::mqttbytes::v5::Publish::new(
            "a/b",
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            "x",
            None,
        );
        publish.pkid = 9;
        Packet::Publish(publish)
    }

    /// A sending session's client and event loop, for a broker on `port`.
    fn session(port: u16) -> (Client, EventLoop) {
        session_with(port, None)
    }

    /// A session's client and event loop, receiving with `receiver`.
    fn session_with(port: u16, receiver: Option<&MqttReceiverSettings>) -> (Client, EventLoop) {
        let settings = MqttSessionSettings::new("t", format!("tcp://127.0.0.1:{port}"), "client-t");
        let endpoint = settings.validate().expect("valid settings");
        create(&settings, &endpoint, receiver).expect("created")
    }

    /// A Unix socket that is not there (the broker not started yet, or a
    /// typo in `broker_url`) fails the connection with its path named.
    #[tokio::test]
    async fn a_missing_unix_socket_is_named() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("mqtt.sock");
        let settings =
            MqttSessionSettings::new("t", format!("unix://{}", path.display()), "client-t");
        let endpoint = settings.validate().expect("valid settings");
        let (_client, mut eventloop) = create(&settings, &endpoint, None).expect("created");
        let error = format!("{:?}", eventloop.poll().await.map(|_| ()));
        assert!(
            error.contains(&path.display().to_string()) && error.contains("No such file"),
            "{error}"
        );
    }

    /// The events of one event loop against a fake broker sending `writes`,
    /// until the connection ends.
    async fn events_until_the_end(writes: Writes) -> Vec<String> {
        let (port, broker) = fake_broker(writes).await;
        let (_client, mut eventloop) = session(port);
        let mut seen = Vec::new();
        loop {
            match eventloop.poll().await {
                Ok(Event::Connected { .. }) => seen.push("connected".to_owned()),
                Ok(Event::Publish(p)) => seen.push(format!("publish {}", p.pkid)),
                Ok(other) => seen.push(format!("{other:?}")),
                Err(e) => {
                    seen.push(format!("ended: {e}"));
                    break;
                }
            }
        }
        broker.abort();
        seen
    }

    /// A publish read in the same read as the broker's DISCONNECT is
    /// reported before the connection's end, so the session acknowledges it
    /// (or not) on that connection, not under its packet id on the next; on
    /// a connection that ends before it was reported connected, nothing of
    /// it is reported (the broker sends the publish again).
    #[tokio::test]
    async fn what_was_read_before_the_connection_ended_is_reported_before_the_end() {
        use rumqttc::v5::mqttbytes::v5::{Disconnect, DisconnectReasonCode};
        let disconnect =
            || Packet::Disconnect(Disconnect::new(DisconnectReasonCode::ServerShuttingDown));
        let end = "ended: the broker disconnected: ServerShuttingDown";
        let seen = events_until_the_end(vec![
            vec![test_connack(None, None)],
            vec![publish_9(), disconnect()],
        ])
        .await;
        assert_eq!(seen, ["connected", "publish 9", end]);
        let seen = events_until_the_end(vec![vec![
            test_connack(None, None),
            publish_9(),
            disconnect(),
        ]])
        .await;
        assert_eq!(seen, [end]);
    }

    /// While the receiver holds reads the loop leaves what the broker sent
    /// unread, unless it awaits an answer (here a PUBACK of its own
    /// publish): a session that also sends never waits behind it.
    #[tokio::test]
    async fn held_reads_wait_unless_an_answer_is_awaited() {
        for awaiting in [false, true] {
            let (port, broker) =
                fake_broker(vec![vec![test_connack(None, None)], vec![publish_9()]]).await;
            let (client, mut eventloop) = session(port);
            // The next event, or "nothing" within `ms`.
            let next = async |eventloop: &mut EventLoop, ms: u64| match tokio::time::timeout(
                Duration::from_millis(ms),
                eventloop.poll(),
            )
            .await
            {
                Err(_) => "nothing".to_owned(),
                Ok(Ok(Event::Publish(p))) => format!("publish {}", p.pkid),
                Ok(other) => format!("{other:?}"),
            };
            assert!(next(&mut eventloop, 2_000).await.contains("Connected"));
            client.hold_reads(true);
            if awaiting {
                let envelope = crate::stores::conformance::envelope("a");
                let ours = Publish::v5("t", Qos::AtLeastOnce, false, &envelope, SystemTime::now());
                assert!(client.try_publish(ours.expect("valid")).is_ok());
                assert_eq!(next(&mut eventloop, 2_000).await, "Ok(PublishWritten(1))");
                let read = next(&mut eventloop, 2_000).await;
                assert_eq!(read, "publish 9", "read while its PUBACK is awaited");
            } else {
                let read = next(&mut eventloop, 300).await;
                assert_eq!(read, "nothing", "nothing read while held");
                client.hold_reads(false);
                assert_eq!(next(&mut eventloop, 2_000).await, "publish 9");
            }
            broker.abort();
        }
    }

    /// A sending session on `port` that has written `n` publishes of `qos`.
    async fn sent(port: u16, n: usize, qos: Qos) -> EventLoop {
        publish_all(session(port), n, qos).await
    }

    /// `session` once connected and once it has written `n` publishes of
    /// `qos`.
    async fn publish_all(session: (Client, EventLoop), n: usize, qos: Qos) -> EventLoop {
        let (client, mut eventloop) = session;
        let connected = tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await;
        assert!(matches!(connected, Ok(Ok(Event::Connected { .. }))));
        let envelope = crate::stores::conformance::envelope("a");
        for _ in 0..n {
            let publish = Publish::v5("t", qos, false, &envelope, SystemTime::now());
            assert!(client.try_publish(publish.expect("valid")).is_ok());
        }
        for pkid in 1..=n {
            let written = tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await;
            let written = format!("{written:?}");
            assert_eq!(written, format!("Ok(Ok(PublishWritten({pkid})))"));
        }
        eventloop
    }

    /// The next `n` events, each an accepted publish's answer (PUBACK or
    /// PUBCOMP) within 5 s: their ids, and when each was reported.
    async fn acks(eventloop: &mut EventLoop, n: usize) -> Vec<(u16, Instant)> {
        let mut acked = Vec::new();
        while acked.len() < n {
            match tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await {
                Ok(Ok(Event::Acked {
                    pkid,
                    refused: None,
                })) => acked.push((pkid, Instant::now())),
                other => panic!("{other:?} after {} answers", acked.len()),
            }
        }
        acked
    }

    /// Answers read in batches (`low_water`): with eighteen PUBACKs owed
    /// the loop waits for four (16 bytes) before it reads, so the first is
    /// reported only after the fourth was sent; and as they arrive one by
    /// one, 50 ms apart, it lowers its mark before each wait, so the last two
    /// (8 bytes) are read too.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn answers_are_read_in_batches_and_the_last_ones_too() {
        use rumqttc::v5::mqttbytes::v5::PubAck;
        let mut publishes = 0;
        let (port, written, broker) = broker(move |packet| match packet {
            Packet::Connect(..) => vec![vec![test_connack(None, None)]],
            Packet::Publish(_) => {
                publishes += 1;
                if publishes < 18 {
                    return Vec::new();
                }
                let pubacks = (1..=18).map(|pkid| vec![Packet::PubAck(PubAck::new(pkid, None))]);
                pubacks.collect()
            }
            _ => Vec::new(),
        })
        .await;
        let mut eventloop = sent(port, 18, Qos::AtLeastOnce).await;
        let acked = acks(&mut eventloop, 18).await;
        let pkids: Vec<u16> = acked.iter().map(|(pkid, _)| *pkid).collect();
        assert_eq!(pkids, (1..=18).collect::<Vec<u16>>());
        // The CONNACK was the broker's first write, the fourth PUBACK its fifth.
        let fourth_sent = written.lock().expect("unpoisoned")[4];
        assert!(acked[0].1 >= fourth_sent, "the first PUBACK read alone");
        broker.abort();
    }

    /// A receiving session reads as packets come (`low_water` invariant 2):
    /// with eighteen publishes of its own owed a PUBACK, a sending session
    /// would wait for 16 bytes, but the broker's one publish (11) is read
    /// at once.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_receiving_session_reads_a_publish_while_answers_are_owed() {
        let mut publishes = 0;
        let (port, _, broker) = broker(move |packet| match packet {
            Packet::Connect(..) => vec![vec![test_connack(None, None)]],
            Packet::Publish(_) => {
                publishes += 1;
                if publishes < 18 {
                    Vec::new()
                } else {
                    vec![vec![publish_9()]]
                }
            }
            _ => Vec::new(),
        })
        .await;
        let receiver = MqttReceiverSettings::new(vec![("a/#".into(), Qos::AtLeastOnce)]);
        let session = session_with(port, Some(&receiver));
        let mut eventloop = publish_all(session, 18, Qos::AtLeastOnce).await;
        // Well under the keep-alive (30 s), whose PINGREQ would lower a mark
        // and let the publish through.
        let read = tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await;
        assert!(
            matches!(read, Ok(Ok(Event::Publish(ref p))) if p.pkid == 9),
            "{read:?}"
        );
        broker.abort();
    }

    /// QoS 2 under the mark: with nine publishes owed (mark 8 bytes) their
    /// PUBRECs come one by one, 4 bytes each, and are read two at a time;
    /// the ninth waits under the mark until the PUBCOMPs of the first eight
    /// bring it in (the broker answers each PUBREL on its own, once it has
    /// written its PUBRECs), so every publish completes, in order.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn qos_2_exchanges_complete_under_the_mark() {
        use rumqttc::v5::mqttbytes::v5::{PubComp, PubRec};
        const N: u16 = 9;
        let mut publishes = 0;
        let (port, _, broker) = broker(move |packet| match packet {
            Packet::Connect(..) => vec![vec![test_connack(None, None)]],
            Packet::Publish(_) => {
                publishes += 1;
                let pubrecs = (1..=N).map(|pkid| vec![Packet::PubRec(PubRec::new(pkid, None))]);
                if publishes < N {
                    Vec::new()
                } else {
                    pubrecs.collect()
                }
            }
            Packet::PubRel(pubrel) => vec![vec![Packet::PubComp(PubComp::new(pubrel.pkid, None))]],
            _ => Vec::new(),
        })
        .await;
        let mut eventloop = sent(port, usize::from(N), Qos::ExactlyOnce).await;
        let completed = acks(&mut eventloop, usize::from(N)).await;
        let pkids: Vec<u16> = completed.iter().map(|(pkid, _)| *pkid).collect();
        assert_eq!(pkids, (1..=N).collect::<Vec<u16>>());
        broker.abort();
    }

    /// A resumed session releases what it owes under the mark: nine QoS 2
    /// publishes are PUBREC'd and the connection ends before any PUBCOMP;
    /// the broker resumes the session, the loop sends the nine PUBRELs
    /// again (their ids stay taken), and the PUBCOMPs, one by one, are
    /// read two at a time and the last ones too, each id then free.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_resumed_session_completes_its_pubrels_under_the_mark() {
        use rumqttc::v5::mqttbytes::v5::{PubComp, PubRec};
        const N: u16 = 9;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let port = listener.local_addr().expect("bound").port();
        // Reads packets until `n` satisfy `wanted`, answering nothing.
        async fn read_until(
            socket: &mut tokio::net::TcpStream,
            read: &mut BytesMut,
            mut n: usize,
            wanted: impl Fn(&Packet) -> bool,
        ) {
            while n > 0 {
                match Packet::read(read, None) {
                    Ok(packet) => n -= usize::from(wanted(&packet)),
                    Err(_) => assert!(socket.read_buf(read).await.is_ok_and(|r| r > 0)),
                }
            }
        }
        async fn write(socket: &mut tokio::net::TcpStream, packets: &[Packet]) {
            let mut out = BytesMut::new();
            for packet in packets {
                packet.write(&mut out, None).expect("encodable");
            }
            socket.write_all(&out).await.expect("written");
        }
        let broker = tokio::spawn(async move {
            let (mut first, _) = listener.accept().await.expect("a client");
            let mut read = BytesMut::new();
            read_until(&mut first, &mut read, 1, |p| {
                matches!(p, Packet::Connect(..))
            })
            .await;
            write(&mut first, &[test_connack(None, None)]).await;
            read_until(&mut first, &mut read, N.into(), |p| {
                matches!(p, Packet::Publish(_))
            })
            .await;
            let pubrecs: Vec<Packet> = (1..=N)
                .map(|id| Packet::PubRec(PubRec::new(id, None)))
                .collect();
            write(&mut first, &pubrecs).await;
            read_until(&mut first, &mut read, N.into(), |p| {
                matches!(p, Packet::PubRel(_))
            })
            .await;
            drop(first);

            let (mut second, _) = listener.accept().await.expect("the client again");
            let mut read = BytesMut::new();
            read_until(&mut second, &mut read, 1, |p| {
                matches!(p, Packet::Connect(..))
            })
            .await;
            let Packet::ConnAck(mut resumed) = test_connack(None, None) else {
                unreachable!("a CONNACK")
            };
            resumed.session_present = true;
            write(&mut second, &[Packet::ConnAck(resumed)]).await;
            read_until(&mut second, &mut read, N.into(), |p| {
                matches!(p, Packet::PubRel(_))
            })
            .await;
            for id in 1..=N {
                write(&mut second, &[Packet::PubComp(PubComp::new(id, None))]).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            second
        });
        let mut eventloop = sent(port, usize::from(N), Qos::ExactlyOnce).await;
        let ended = tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await;
        assert!(
            matches!(ended, Ok(Err(_))),
            "the first connection ends: {ended:?}"
        );
        let resumed = tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await;
        assert!(
            matches!(
                resumed,
                Ok(Ok(Event::Connected {
                    session_present: true,
                    ..
                }))
            ),
            "{resumed:?}"
        );
        let completed = acks(&mut eventloop, usize::from(N)).await;
        let pkids: Vec<u16> = completed.iter().map(|(pkid, _)| *pkid).collect();
        assert_eq!(pkids, (1..=N).collect::<Vec<u16>>());
        let connection = eventloop.connection.as_ref().expect("connected");
        assert!(connection.inflight.pending.is_empty(), "every id released");
        broker.abort();
    }

    /// A PINGREQ's 2-byte PINGRESP is read while many PUBACKs are owed: the
    /// mark goes back to 1 while it is awaited, so the keep-alive (1 s, the
    /// broker's) does not end the connection (it would at about 2 s).
    #[tokio::test]
    async fn a_pingresp_is_read_while_answers_are_owed() {
        use rumqttc::v5::mqttbytes::v5::PingResp;
        let (port, _, broker) = broker(|packet| match packet {
            Packet::Connect(..) => vec![vec![test_connack(None, Some(1))]],
            Packet::PingReq(_) => vec![vec![Packet::PingResp(PingResp)]],
            _ => Vec::new(),
        })
        .await;
        let mut eventloop = sent(port, 18, Qos::AtLeastOnce).await;
        let alive = tokio::time::timeout(Duration::from_millis(2_500), eventloop.poll()).await;
        assert!(alive.is_err(), "within 2.5 s: {alive:?}");
        broker.abort();
    }

    #[test]
    fn ids_cycle_through_the_window_and_are_not_reused_in_flight() {
        let mut inflight = Inflight::new(3);
        let publish = Pending::Publish(Qos::AtLeastOnce);
        let ids: Vec<_> = (0..3).map(|_| inflight.allocate(publish, 3)).collect();
        assert_eq!(ids, [Some(1), Some(2), Some(3)]);
        assert_eq!(inflight.allocate(publish, 3), None, "the window is full");
        inflight.pending.remove(&2);
        assert_eq!(inflight.allocate(publish, 3), Some(2), "only 2 is free");
        inflight.pending.remove(&1);
        inflight.pending.remove(&3);
        assert_eq!(inflight.allocate(publish, 3), Some(3));
        assert_eq!(inflight.allocate(publish, 3), Some(1));
        // A subscription may take an id beyond a full publish window.
        assert_eq!(inflight.allocate(Pending::Subscribe, u16::MAX), Some(4));
    }
}
