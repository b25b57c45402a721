//! The staged outage, step by step: planned; the upstream listener down;
//! back and draining; over. Each step prints what happened, and the last one
//! the outage's figures: how long it lasted, how deep the outbox got (the
//! agent's figures), how long the drain took after the listener came back,
//! and whether every reading published until then arrived everywhere (the
//! subscriber's counts).

use std::time::Duration;

use tokio::time::Instant;

use crate::listener::Listener;
use crate::view::{self, Screen};

/// How long the outbox may take to drain, after an outage or at the end.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The outage: planned, the listener down, draining, over.
#[derive(Debug)]
pub enum Outage {
    /// No outage asked for, or it is over.
    None,
    Planned {
        after: Duration,
        length: Duration,
    },
    Down {
        since: Instant,
        length: Duration,
        published_before: u64,
        duplicates_before: u64,
        peak: u64,
    },
    Draining {
        down_for: Duration,
        back: Instant,
        published_before: u64,
        published_until: u64,
        duplicates_before: u64,
        peak: u64,
    },
}

impl Outage {
    /// An outage of `length`, `after` the first reading; none for a zero
    /// length.
    pub fn planned(after: Duration, length: Duration) -> Self {
        if length.is_zero() {
            Self::None
        } else {
            Self::Planned { after, length }
        }
    }

    /// Counts the largest outbox depth seen during the outage and its drain.
    pub fn saw_depth(&mut self, depth: Option<u64>) {
        if let (Self::Down { peak, .. } | Self::Draining { peak, .. }, Some(depth)) = (self, depth)
        {
            *peak = (*peak).max(depth);
        }
    }

    /// Moves on when it is time: takes the listener down (`after` the first
    /// reading, published `publishing` ago), brings it back, reports the
    /// drain once everything published before the listener came back
    /// arrived (`arrived_below`).
    pub async fn step(
        &mut self,
        listener: &mut Listener,
        screen: &mut Screen,
        publishing: Duration,
        published: u64,
        duplicates: u64,
        arrived_below: impl Fn(u64) -> bool,
    ) -> anyhow::Result<()> {
        match *self {
            Self::None => {}
            Self::Planned { after, length } => {
                if publishing >= after {
                    listener.take_down().await;
                    screen.event(&format!(
                        "outage: upstream listener DOWN for {}: the agent cannot reach the upstream broker; the readings wait in the outbox",
                        view::duration_text(length)
                    ));
                    *self = Self::Down {
                        since: Instant::now(),
                        length,
                        published_before: published,
                        duplicates_before: duplicates,
                        peak: 0,
                    };
                }
            }
            Self::Down { since, length, .. } => {
                if since.elapsed() >= length {
                    self.bring_back(listener, screen, published).await?;
                }
            }
            Self::Draining {
                down_for,
                back,
                published_before,
                published_until,
                duplicates_before,
                peak,
            } => {
                let during = published_until - published_before;
                if arrived_below(published_until) {
                    screen.event(&format!(
                        "outage {}: outbox depth peaked at {peak} per destination; drained {} after the listener came back; all {during} readings published during the outage arrived at every destination ({} duplicates)",
                        view::duration_text(down_for),
                        view::duration_text(back.elapsed()),
                        duplicates - duplicates_before,
                    ));
                    *self = Self::None;
                } else if back.elapsed() > DRAIN_TIMEOUT {
                    screen.event(&format!(
                        "outage {}: not drained {} after the listener came back",
                        view::duration_text(down_for),
                        view::duration_text(DRAIN_TIMEOUT),
                    ));
                    *self = Self::None;
                }
            }
        }
        Ok(())
    }

    /// At the end: a listener still down comes back now, so the outbox
    /// can drain.
    pub async fn cut_short(
        &mut self,
        listener: &mut Listener,
        screen: &mut Screen,
    ) -> anyhow::Result<()> {
        let published = match self {
            Self::Down {
                published_before, ..
            } => *published_before,
            _ => 0,
        };
        self.bring_back(listener, screen, published).await
    }

    async fn bring_back(
        &mut self,
        listener: &mut Listener,
        screen: &mut Screen,
        published: u64,
    ) -> anyhow::Result<()> {
        listener.bring_back().await?;
        if let Self::Down {
            since,
            published_before,
            duplicates_before,
            peak,
            ..
        } = *self
        {
            let down_for = since.elapsed();
            screen.event(&format!(
                "outage: upstream listener back after {}: the agent reconnects and drains the outbox",
                view::duration_text(down_for)
            ));
            *self = Self::Draining {
                down_for,
                back: Instant::now(),
                published_before,
                published_until: published.max(published_before),
                duplicates_before,
                peak,
            };
        }
        Ok(())
    }
}
