//! Settings written `true`, `false` or one word for a third way (`auto`, `slower`): a switch
//! that grew a middle keeps every file written for the switch valid.

use std::marker::PhantomData;

use serde::{de, Deserializer};

use crate::routing::{LearnedRate, Placement};

/// A setting's three values and the word of its third.
pub trait Switch: Sized {
    const WORD: &'static str;
    fn on() -> Self;
    fn off() -> Self;
    fn third() -> Self;
}

/// For `#[serde(deserialize_with = "switch")]`.
pub fn switch<'de, D: Deserializer<'de>, T: Switch>(d: D) -> Result<T, D::Error> {
    struct Visitor<T>(PhantomData<T>);
    impl<T: Switch> de::Visitor<'_> for Visitor<T> {
        type Value = T;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "true, false or {}", T::WORD)
        }

        fn visit_bool<E: de::Error>(self, on: bool) -> Result<T, E> {
            Ok(if on { T::on() } else { T::off() })
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<T, E> {
            if s == T::WORD {
                Ok(T::third())
            } else {
                Err(E::invalid_value(de::Unexpected::Str(s), &self))
            }
        }
    }
    d.deserialize_any(Visitor(PhantomData))
}

impl Switch for Placement {
    const WORD: &'static str = "auto";
    fn on() -> Self {
        Placement::Always
    }
    fn off() -> Self {
        Placement::Never
    }
    fn third() -> Self {
        Placement::Auto
    }
}

impl Switch for LearnedRate {
    const WORD: &'static str = "slower";
    fn on() -> Self {
        LearnedRate::Always
    }
    fn off() -> Self {
        LearnedRate::Never
    }
    fn third() -> Self {
        LearnedRate::Slower
    }
}
