//! From the file to the settings: every value checked first (`check`, pure), then what the
//! file names outside itself looked up in one place (`resolve`). Every error names its field.

mod check;
mod peers;
mod proxy;
mod resolve;
mod router;
mod traces;
mod values;

use super::error::ConfigError;
use super::schema::{peers::Peer, File};
use crate::routing::PeerSpec;
use crate::settings::Settings;

impl File {
    pub fn into_settings(self) -> Result<Settings, ConfigError> {
        resolve::resolve(check::check(self)?)
    }
}

/// The peers of a peers file, checked and resolved.
pub fn peers(listed: &[Peer]) -> Result<Vec<PeerSpec>, ConfigError> {
    resolve::peers(&peers::peers(listed)?)
}
