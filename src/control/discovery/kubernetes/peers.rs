//! The peers a set of EndpointSlices names: each ready endpoint's first address with the
//! chosen port, weighted by the annotations of its slice, else of its Service, else by the
//! configuration.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use kube::ResourceExt;

use crate::routing::{PeerSpec, Weight};
use crate::settings::{KubePort, Kubernetes};

/// The peer's weight, 1 to 100.
pub const WEIGHT: &str = "prefixlb.io/weight";
/// Its in-flight ceiling, at least 1.
pub const MAX_IN_FLIGHT: &str = "prefixlb.io/max-in-flight";
/// The models it serves, separated by commas.
pub const MODELS: &str = "prefixlb.io/models";
/// The label the EndpointSlice controller puts on each slice: its Service's name.
pub const SERVICE_NAME: &str = "kubernetes.io/service-name";

/// What a peer is given besides its address.
#[derive(Clone)]
struct Terms {
    weight: Weight,
    max_in_flight: u32,
    models: Option<Vec<String>>,
}

impl Terms {
    /// These terms with those `annotations` change; an annotation that does not read is
    /// skipped with a warning, the rest still apply.
    fn annotated(mut self, annotations: &BTreeMap<String, String>, of: &str) -> Self {
        let warn = |key: &str, value: &str, why: &str| {
            log::warn!("kubernetes: {of}: annotation {key}: {value:?} ignored: {why}");
        };
        if let Some(v) = annotations.get(WEIGHT) {
            match v.trim().parse().ok().and_then(Weight::new) {
                Some(w) => self.weight = w,
                None => warn(WEIGHT, v, "not a weight from 1 to 100"),
            }
        }
        if let Some(v) = annotations.get(MAX_IN_FLIGHT) {
            match v.trim().parse::<u32>() {
                Ok(n) if n > 0 => self.max_in_flight = n,
                _ => warn(MAX_IN_FLIGHT, v, "not a number from 1 up"),
            }
        }
        if let Some(v) = annotations.get(MODELS) {
            let models: Vec<String> = v
                .split(',')
                .map(str::trim)
                .filter(|m| !m.is_empty())
                .map(str::to_owned)
                .collect();
            // An empty list says "any", as no annotation does.
            self.models = (!models.is_empty()).then_some(models);
        }
        self
    }
}

/// The peers of `slices`, ordered by address; an address in two slices (a pod moving between
/// them) is one peer, as the slice first by name gives it.
pub fn peers(
    settings: &Kubernetes,
    slices: &BTreeMap<String, EndpointSlice>,
    services: &BTreeMap<String, Service>,
) -> Vec<PeerSpec> {
    let defaults = Terms {
        weight: settings.weight,
        max_in_flight: settings.max_in_flight,
        models: None,
    };
    let mut found = BTreeMap::new();
    for (name, slice) in slices {
        let of = format!("EndpointSlice {name}");
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            log::warn!(
                "kubernetes: {of} skipped: its addresses are {}, not IPs",
                slice.address_type
            );
            continue;
        }
        let Some(port) = port(settings.port.as_ref(), slice, &of) else {
            continue;
        };
        let service = slice
            .labels()
            .get(SERVICE_NAME)
            .and_then(|s| Some((s, services.get(s)?)));
        let mut terms = defaults.clone();
        if let Some((service_name, service)) = service {
            terms = terms.annotated(service.annotations(), &format!("Service {service_name}"));
        }
        let terms = terms.annotated(slice.annotations(), &of);
        for ip in slice.endpoints.iter().filter_map(ready_address) {
            let addr = SocketAddr::new(ip, port);
            found.entry(addr).or_insert_with(|| PeerSpec {
                addr,
                weight: terms.weight,
                max_in_flight: terms.max_in_flight,
                tls: None,
                models: terms.models.clone(),
            });
        }
    }
    found.into_values().collect()
}

/// The port of a slice's endpoints: the configured number, the port of the configured name,
/// or the slice's only port; `None`, with a warning, when there is none to take.
fn port(wanted: Option<&KubePort>, slice: &EndpointSlice, of: &str) -> Option<u16> {
    slice_port(wanted, slice)
        .inspect_err(|why| log::warn!("kubernetes: {of} skipped: {why}"))
        .ok()
}

fn slice_port(wanted: Option<&KubePort>, slice: &EndpointSlice) -> Result<u16, String> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let found = match wanted {
        Some(KubePort::Number(n)) => return Ok(*n),
        Some(KubePort::Name(name)) => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .ok_or_else(|| format!("it has no port named {name}"))?,
        None => match ports {
            [only] => only,
            _ => {
                return Err(format!(
                    "it has {} ports: name one in discovery.kubernetes.port",
                    ports.len()
                ))
            }
        },
    };
    // A slice port without a number stands for every port, which says nothing usable.
    found
        .port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p > 0)
        .ok_or_else(|| "its port has no number".to_owned())
}

/// The address of an endpoint that takes requests: not known to be unready, not terminating.
/// The first of its addresses: the others, if any, are the same pod.
fn ready_address(endpoint: &Endpoint) -> Option<IpAddr> {
    let conditions = endpoint.conditions.clone().unwrap_or_default();
    if conditions.ready == Some(false) || conditions.terminating == Some(true) {
        return None;
    }
    endpoint.addresses.first()?.parse().ok()
}
