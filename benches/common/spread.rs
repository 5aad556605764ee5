//! A figure's median over seeds or runs, with its spread, as the cluster, engines and overhead
//! benches print it.

/// The median of a figure over seeds or runs (the mean of the middle two when even), with its
/// least and greatest; NaN for none.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(mut values: Vec<f64>) -> Spread {
        values.sort_by(f64::total_cmp);
        let n = values.len();
        if n == 0 {
            return Spread {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        Spread {
            median,
            min: values[0],
            max: values[n - 1],
        }
    }

    /// `median (min-max)`, each with `decimals` places.
    pub fn show(&self, decimals: usize) -> String {
        format!(
            "{:.d$} ({:.d$}-{:.d$})",
            self.median,
            self.min,
            self.max,
            d = decimals
        )
    }
}
