//! prefixlb's own configuration: one YAML file in, [`Settings`] out. Pingora's server settings
//! stay in Pingora's file (`-c`).
//!
//! `schema` is the file as users write it, `convert` checks it and turns it into settings.
//! Every error names the field and the reason: unknown keys, wrong types and bad values alike.

mod convert;
mod error;
pub mod schema;

use std::path::Path;

use crate::routing::PeerSpec;
use crate::settings::Settings;
pub use error::ConfigError;

/// Parses YAML into `T`, naming the field of any error.
fn from_yaml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    let de = serde_yaml::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = match e.path().to_string() {
            root if root == "." => String::new(),
            path => path,
        };
        // serde_yaml starts its message with the path of the enclosing value; the field
        // already says it.
        let message = e.into_inner().to_string();
        let reason = match message.split_once(": ") {
            Some((prefix, rest)) if !field.is_empty() && field.starts_with(prefix) => {
                rest.to_owned()
            }
            _ => message,
        };
        ConfigError::new(field, reason)
    })
}

/// Reads and checks prefixlb's file.
pub fn load(path: &Path) -> Result<Settings, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new("", format!("cannot read {}: {e}", path.display())))?;
    parse(&text)
}

/// Checks prefixlb's file, given as text.
pub fn parse(text: &str) -> Result<Settings, ConfigError> {
    from_yaml::<schema::File>(text)?.into_settings()
}

/// The peers of a peers file: `peers: [...]`, in the same form as the main file's.
pub fn parse_peers_file(text: &str) -> Result<Vec<PeerSpec>, ConfigError> {
    convert::peers(&from_yaml::<schema::PeersFile>(text)?.peers)
}
