//! A tenant's admission: whether it has room for one more request now, and the hold a request
//! keeps on its place until it ends.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::limits::{Bucket, Limits, OverLimit};

/// One API key's tenant: its limits and what it spends now. Kept across reloads of the file
/// while the key's name stays, so a reload does not hand a tenant fresh allowances.
#[derive(Debug)]
pub struct Tenant {
    name: String,
    limits: Mutex<Limits>,
    in_flight: AtomicU32,
    requests: Mutex<Option<Bucket>>,
    bytes: Mutex<Option<Bucket>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one assignment: the value is whole after any panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Tenant {
    pub(crate) fn new(name: String, limits: Limits) -> Self {
        Self {
            name,
            limits: Mutex::new(limits),
            in_flight: AtomicU32::new(0),
            requests: Mutex::new(None),
            bytes: Mutex::new(None),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn limits(&self) -> Limits {
        *lock(&self.limits)
    }

    /// The limits a reloaded file gives the tenant; what it spends now stays.
    pub(crate) fn set_limits(&self, limits: Limits) {
        *lock(&self.limits) = limits;
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// A place for one request, if the tenant has room: held until the request ends.
    pub fn admit(self: &Arc<Self>) -> Result<TenantSlot, OverLimit> {
        self.admit_at(Instant::now())
    }

    fn admit_at(self: &Arc<Self>, now: Instant) -> Result<TenantSlot, OverLimit> {
        let limits = self.limits();
        let cap = limits.max_concurrent.unwrap_or(u32::MAX);
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .map_err(|_| OverLimit::Concurrency)?;
        let slot = TenantSlot(Arc::clone(self));
        if let Some(rate) = limits.requests_per_second {
            take(&self.requests, rate, 1.0, now).map_err(OverLimit::Requests)?;
        }
        Ok(slot)
    }

    /// Charges a request's prompt bytes to the tenant's byte rate.
    pub fn charge_prompt(&self, bytes: usize) -> Result<(), OverLimit> {
        self.charge_prompt_at(bytes, Instant::now())
    }

    fn charge_prompt_at(&self, bytes: usize, now: Instant) -> Result<(), OverLimit> {
        match self.limits().prompt_bytes_per_second {
            Some(rate) => {
                take(&self.bytes, rate, bytes as f64, now).map_err(OverLimit::PromptBytes)
            }
            None => Ok(()),
        }
    }
}

fn take(
    bucket: &Mutex<Option<Bucket>>,
    rate: f64,
    cost: f64,
    now: Instant,
) -> Result<(), Duration> {
    lock(bucket)
        .get_or_insert_with(|| Bucket::full(rate, now))
        .take(rate, cost, now)
}

/// A tenant's hold on one of its concurrent requests; released when dropped.
#[derive(Debug)]
pub struct TenantSlot(Arc<Tenant>);

impl Drop for TenantSlot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::limits::LONGEST_WAIT;

    fn tenant(limits: Limits) -> Arc<Tenant> {
        Arc::new(Tenant::new("a".into(), limits))
    }

    #[test]
    fn concurrency_cap_holds_and_a_released_slot_is_given_again() {
        let a = tenant(Limits {
            max_concurrent: Some(2),
            ..Limits::default()
        });
        let first = a.admit().unwrap();
        let _second = a.admit().unwrap();
        assert_eq!(a.admit().unwrap_err(), OverLimit::Concurrency);
        drop(first);
        assert!(a.admit().is_ok());
        assert_eq!(a.in_flight(), 1);
    }

    #[test]
    fn a_refused_rate_does_not_hold_a_concurrent_slot() {
        let a = tenant(Limits {
            requests_per_second: Some(2.0),
            ..Limits::default()
        });
        let now = Instant::now();
        drop(a.admit_at(now).unwrap());
        drop(a.admit_at(now).unwrap());
        let refused = a.admit_at(now).unwrap_err();
        assert!(matches!(refused, OverLimit::Requests(d) if d > Duration::ZERO));
        assert_eq!(refused.retry_after_secs(), 1);
        assert_eq!(a.in_flight(), 0);
        assert!(a.admit_at(now + Duration::from_millis(600)).is_ok());
    }

    #[test]
    fn a_prompt_over_a_seconds_allowance_passes_once_and_the_debt_delays_the_next() {
        let a = tenant(Limits {
            prompt_bytes_per_second: Some(1000.0),
            ..Limits::default()
        });
        let now = Instant::now();
        a.charge_prompt_at(5000, now).unwrap();
        let refused = a.charge_prompt_at(10, now).unwrap_err();
        // 4,000 bytes of debt and 10 more at 1,000 a second.
        assert_eq!(refused, OverLimit::PromptBytes(Duration::from_millis(4010)));
        assert_eq!(refused.retry_after_secs(), 5);
        a.charge_prompt_at(10, now + Duration::from_millis(4010))
            .unwrap();
    }

    #[test]
    fn a_tiny_rate_names_a_bounded_wait() {
        let a = tenant(Limits {
            requests_per_second: Some(1e-300),
            ..Limits::default()
        });
        let now = Instant::now();
        drop(a.admit_at(now).unwrap());
        assert_eq!(
            a.admit_at(now).unwrap_err(),
            OverLimit::Requests(LONGEST_WAIT)
        );
    }
}
