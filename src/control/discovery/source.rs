//! What a peer source is to the control plane: something that says, when asked, which peers
//! there are now.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::Error;
use crate::routing::PeerSpec;

/// What start-up does with a source before serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtStart {
    /// Its peers came with the configuration already: nothing more to read.
    Loaded,
    /// Read before serving; a failure stops the start.
    Required,
    /// Read before serving; a failure starts without peers (a service that is down now may be
    /// back in a moment), except when only checking the configuration.
    Tried,
}

/// A list of peers kept somewhere (a file, DNS, a registry), read again every
/// [`interval`](PeerSource::interval) and on SIGHUP.
#[async_trait]
pub trait PeerSource: Send {
    /// Where the peers come from, for the log.
    fn label(&self) -> String;

    /// How often the control plane asks again.
    fn interval(&self) -> Duration;

    fn at_start(&self) -> AtStart;

    /// The peers the source lists now; `Ok(None)` when nothing changed since the last call and
    /// `force` is off.
    async fn peers(&mut self, force: bool) -> Result<Option<Vec<PeerSpec>>, Error>;

    /// Drops the connections the source keeps: they belong to the runtime they were made on.
    fn disconnect(&mut self) {}
}
