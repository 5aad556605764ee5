//! `tracing`, checked: a URL a collector can be reached at, a ratio, headers HTTP can carry.

use http::{HeaderName, HeaderValue, Uri};

use super::values::{millis, share};
use crate::config::error::ConfigError;
use crate::config::schema::traces::TracingFile;
use crate::settings::TraceSettings;

pub fn traces(t: TracingFile) -> Result<TraceSettings, ConfigError> {
    let endpoint = endpoint(&t.otlp_endpoint)?;
    if t.service_name.is_empty() {
        return Err(ConfigError::new(
            "tracing.service_name",
            "must not be empty",
        ));
    }
    for (name, value) in &t.headers {
        let field = format!("tracing.headers.{name}");
        HeaderName::try_from(name.as_str())
            .map_err(|_| ConfigError::new(&field, "is not a header name"))?;
        HeaderValue::try_from(value.as_str())
            .map_err(|_| ConfigError::new(&field, "is not a header value"))?;
    }
    Ok(TraceSettings {
        endpoint,
        service_name: t.service_name,
        sample_ratio: share("tracing.sample_ratio", t.sample_ratio)?,
        headers: t.headers.into_iter().collect(),
        timeout: millis("tracing.timeout_ms", t.timeout_ms)?,
    })
}

/// The whole URL spans are posted to: the exporter adds no `/v1/traces` of its own, so a
/// collector behind a path prefix can be named too.
fn endpoint(text: &str) -> Result<Uri, ConfigError> {
    let field = "tracing.otlp_endpoint";
    let uri: Uri = text
        .parse()
        .map_err(|e| ConfigError::new(field, format!("`{text}` is not a URL ({e})")))?;
    // The endpoint is logged and sent as the Host header: a secret in it would be too, so it is
    // refused before any message repeats the URL.
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(ConfigError::new(
            field,
            "must not hold credentials (user:password@): put them in tracing.headers (authorization)",
        ));
    }
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(ConfigError::new(
            field,
            format!("`{text}` must be an http:// or https:// URL with a host"),
        ));
    }
    if uri.path() == "/" {
        return Err(ConfigError::new(
            field,
            format!("`{text}` names no path: a collector takes spans at /v1/traces"),
        ));
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use crate::config::parse;

    fn field_of(yaml: &str) -> String {
        parse(yaml).unwrap_err().field
    }

    #[test]
    fn tracing_is_off_unless_configured_and_defaults_the_rest() {
        assert!(parse("").unwrap().tracing.is_none());
        let t = parse("tracing: {otlp_endpoint: \"http://127.0.0.1:4318/v1/traces\"}")
            .unwrap()
            .tracing
            .unwrap();
        assert_eq!(t.endpoint.port_u16(), Some(4318));
        assert_eq!(t.service_name, "prefixlb");
        assert_eq!(t.sample_ratio, 1.0);
        assert!(t.headers.is_empty());
    }

    #[test]
    fn a_bad_tracing_value_is_refused_naming_its_field() {
        let at =
            |rest: &str| format!("tracing: {{otlp_endpoint: \"http://c:4318/v1/traces\", {rest}}}");
        assert_eq!(
            field_of("tracing: {otlp_endpoint: \"collector:4318\"}"),
            "tracing.otlp_endpoint"
        );
        assert_eq!(
            field_of("tracing: {otlp_endpoint: \"http://collector:4318\"}"),
            "tracing.otlp_endpoint"
        );
        let with_secret = "tracing: {otlp_endpoint: \"https://u:token@c:4318/v1/traces\"}";
        let e = parse(with_secret).unwrap_err();
        assert_eq!(e.field, "tracing.otlp_endpoint");
        assert!(!e.to_string().contains("token"), "{e}");
        assert_eq!(field_of(&at("sample_ratio: 1.5")), "tracing.sample_ratio");
        assert_eq!(field_of(&at("service_name: \"\"")), "tracing.service_name");
        assert_eq!(field_of(&at("timeout_ms: 0")), "tracing.timeout_ms");
        assert_eq!(
            field_of(&at("headers: {\"bad name\": x}")),
            "tracing.headers.bad name"
        );
    }
}
