//! The moves of old keys, the `advanced` section, and the reference's cover of the schema.

use super::migrate::MOVES;
use super::{from_yaml, parse, parse_renamed, schema};
use crate::routing::Tuning;

/// A value for each old key unlike its default, as the file would write it.
const SAMPLES: &[(&str, &str)] = &[
    ("routing.prefill_tokens_per_second", "2500"),
    ("routing.candidates", "5"),
    ("routing.shared_prefix_placement", "true"),
    ("routing.vnodes_per_weight", "64"),
    ("routing.prefix_record_mib", "2"),
    ("routing.peek_limit_bytes", "4096"),
    ("routing.peek_timeout_ms", "500"),
    ("limits.peek_memory_bytes", "1048576"),
    ("limits.max_body_bytes", "100000"),
    ("limits.client_write_timeout_ms", "700"),
    ("models.default", "base-a"),
    ("routing.key.chat_path", "/my/chat"),
    ("routing.key.completions_path", "/my/completions"),
    ("routing.key.generate_path", "/my/generate"),
    ("access_log", "json"),
    ("access_log_key", "s3cret"),
];

/// `a.b.c` and `v` as the flow mapping `{a: {b: {c: v}}}`; a name ending in `[]` holds a list
/// of one.
fn nest(path: &str, value: &str) -> String {
    path.rsplit('.').fold(value.to_owned(), |inner, name| {
        match name.strip_suffix("[]") {
            Some(list) => format!("{{{list}: [{inner}]}}"),
            None => format!("{{{name}: {inner}}}"),
        }
    })
}

#[test]
fn each_old_key_lands_where_its_new_name_does() {
    let default = format!("{:?}", parse("").unwrap());
    for m in MOVES {
        let sample = SAMPLES
            .iter()
            .find(|(old, _)| *old == m.old)
            .unwrap_or_else(|| panic!("no sample for {}", m.old))
            .1;
        let new_value = match m.scale {
            1 => sample.to_owned(),
            scale => (sample.parse::<u64>().unwrap() * scale).to_string(),
        };
        let (old, renamed) = parse_renamed(&nest(m.old, sample)).unwrap();
        let (new, none) = parse_renamed(&nest(m.new, &new_value)).unwrap();
        let moved: Vec<_> = renamed.iter().map(|r| (r.old, r.new)).collect();
        assert_eq!(moved, [(m.old, m.new)]);
        assert!(none.is_empty(), "{} counts as moved", m.new);
        let warning = renamed[0].to_string();
        assert!(
            warning.starts_with(&format!("{} is now {}", m.old, m.new)),
            "{warning}"
        );
        let (old, new) = (format!("{old:?}"), format!("{new:?}"));
        assert_eq!(old, new, "{} and {}", m.old, m.new);
        assert_ne!(old, default, "{} changed nothing", m.old);
    }
}

#[test]
fn an_old_key_beside_its_new_name_is_refused_naming_both() {
    let e =
        parse("routing: {peek_limit_bytes: 4096}\nproxy: {peek: {limit_bytes: 4096}}").unwrap_err();
    assert_eq!(e.field, "routing.peek_limit_bytes");
    assert!(e.reason.contains("proxy.peek.limit_bytes"), "{e}");
    let e = parse(
        "access_log: plain\naccess_log_key: a\nmodels: {default: a}\nproxy: {default_model: b}",
    )
    .unwrap_err();
    assert_eq!(e.field, "models.default", "{e}");
}

#[test]
fn an_error_at_an_old_key_names_it_as_written() {
    let e = parse("limits: {peek_memory_bytes: 1000}").unwrap_err();
    assert_eq!(e.field, "proxy.peek.memory_bytes");
    assert!(e.reason.contains("limits.peek_memory_bytes"), "{e}");
    let e = parse("routing: {candidates: nine}").unwrap_err();
    assert_eq!(e.field, "routing.least_cost.candidates");
    assert!(e.reason.contains("routing.candidates"), "{e}");
}

#[test]
fn sections_emptied_by_a_move_are_dropped_and_others_stay() {
    let (settings, renamed) =
        parse_renamed("limits: {max_body_bytes: 10}\nmodels: {default: a, discover: true}")
            .unwrap();
    assert_eq!(renamed.len(), 2);
    assert_eq!(settings.proxy.peek.max_body, 10);
    assert_eq!(settings.proxy.default_model.as_deref(), Some("a"));
    assert!(settings.model_discovery.is_some());
}

#[test]
fn advanced_fills_the_cost_models_tuning() {
    let tuning = |yaml: &str| parse(yaml).unwrap().router.balance.cost.tuning;
    assert_eq!(tuning(""), Tuning::DEFAULT);
    let t = tuning(
        "advanced: {warm_hit: 0.8, spill_margin_ms: 0, conversation_floor: 16, \
         conversation_queue: 1.5, prefix_home_share: 1, warm_for_ms: 1000}",
    );
    assert_eq!(
        t,
        Tuning {
            warm_hit: 0.8,
            spill_margin: std::time::Duration::ZERO,
            conversation_floor: 16,
            conversation_queue: 1.5,
            prefix_home_share: 1.0,
            warm_for: std::time::Duration::from_secs(1),
            ..Tuning::DEFAULT
        }
    );
}

#[test]
fn advanced_values_out_of_range_are_refused_naming_the_field() {
    for (key, value) in [
        ("warm_hit", "1.5"),
        ("earlier_hit", "-0.1"),
        ("decode_share", ".nan"),
        ("arrivals", "-1"),
        ("default_decode_ms", "0"),
        ("spill_share", "2"),
        ("future_turns", ".inf"),
        ("unknown_capacity_floor", "0"),
        ("conversation_floor", "0"),
        ("conversation_queue", "-0.5"),
        ("prefix_home_share", "1.5"),
        ("chars_per_token", "0"),
        ("warm_for_ms", "0"),
        ("prefix_record_bytes", "1000"),
        ("vnodes_per_weight", "0"),
    ] {
        let e = parse(&format!("advanced: {{{key}: {value}}}")).unwrap_err();
        assert_eq!(e.field, format!("advanced.{key}"), "{e}");
    }
}

#[test]
fn shared_prefix_placement_is_auto_unless_set() {
    use crate::routing::Placement;
    let placement = |yaml: &str| parse(yaml).map(|s| s.router.balance.cost.shared_prefix_placement);
    let at = |value: &str| {
        placement(&format!(
            "routing: {{least_cost: {{shared_prefix_placement: {value}}}}}"
        ))
    };
    assert_eq!(placement("").unwrap(), Placement::Auto);
    assert_eq!(at("auto").unwrap(), Placement::Auto);
    assert_eq!(at("true").unwrap(), Placement::Always);
    assert_eq!(at("false").unwrap(), Placement::Never);
    let e = at("sometimes").unwrap_err();
    assert!(e.to_string().contains("true, false or auto"), "{e}");
}

#[test]
fn the_learned_prefill_rate_is_priced_as_far_as_asked() {
    use crate::routing::LearnedRate;
    let learned = |yaml: &str| parse(yaml).map(|s| s.router.balance.cost.tuning.learn_prefill_rate);
    let at = |value: &str| learned(&format!("advanced: {{learn_prefill_rate: {value}}}"));
    assert_eq!(learned("").unwrap(), LearnedRate::Slower);
    assert_eq!(at("slower").unwrap(), LearnedRate::Slower);
    assert_eq!(at("true").unwrap(), LearnedRate::Always);
    assert_eq!(at("false").unwrap(), LearnedRate::Never);
    let e = at("faster").unwrap_err();
    assert!(e.to_string().contains("true, false or slower"), "{e}");
}

#[test]
fn values_are_checked_before_any_name_is_resolved() {
    let e = parse("peers: [{addr: \"no-such-host.invalid:1\"}]\nrouting: {balance_factor: 0.5}")
        .unwrap_err();
    assert_eq!(e.field, "routing.balance_factor");
}

/// The names deserialisation accepts where `yaml` puts the unknown key `__probe__`, read off
/// the error it draws; `None` when it draws another (the place is not a section).
fn accepted(yaml: &str) -> Option<Vec<String>> {
    let e = from_yaml::<schema::File>(yaml).unwrap_err();
    let (_, expected) = e.reason.split_once("unknown field `__probe__`, expected")?;
    Some(
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect(),
    )
}

/// Every key of the schema, as `section.key` (`peers[].addr` for a list's items): derived from
/// what deserialisation accepts, so that it cannot drift.
fn schema_keys() -> Vec<String> {
    let mut pending = accepted("__probe__: 0").unwrap();
    let mut keys = Vec::new();
    while let Some(path) = pending.pop() {
        let section = [path.clone(), format!("{path}[]")]
            .into_iter()
            .find_map(|at| Some((accepted(&nest(&at, "{__probe__: 0}"))?, at)));
        match section {
            Some((names, at)) => pending.extend(names.iter().map(|n| format!("{at}.{n}"))),
            None => keys.push(path),
        }
    }
    keys.sort();
    keys
}

#[test]
fn the_reference_describes_every_key() {
    let reference = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    let keys = schema_keys();
    assert!(keys.len() > 60, "{keys:?}");
    let missing: Vec<_> = keys
        .iter()
        .filter(|k| !reference.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md lacks {missing:?}"
    );
    for m in MOVES {
        let row = format!("| `{}`", m.old);
        assert!(
            reference
                .lines()
                .any(|l| l.starts_with(&row) && l.contains(&format!("`{}`", m.new))),
            "docs/configuration.md lacks the row {} -> {}",
            m.old,
            m.new
        );
    }
}

#[test]
fn the_sample_configuration_uses_current_keys() {
    let sample = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/prefixlb.yaml");
    let (_, renamed) = super::load(&sample).unwrap();
    let old: Vec<_> = renamed.iter().map(|r| r.old).collect();
    assert!(old.is_empty(), "{old:?}");
}
