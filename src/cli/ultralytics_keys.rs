//! What `ptl val`, `ptl predict` and `ptl export` answer for an Ultralytics key they have no key
//! of their own for: the keys `ptl train` has none of take the values that change nothing here
//! and refuse others with the reason (`ptl_trainer::pose::foreign_keys`), and a training setting
//! is refused as one — so that every key of Ultralytics' `default.yaml` means the same here or
//! says why not, never "unknown key".

use ptl_trainer::pose::{foreign_keys, PoseTrainConfig};

/// `Some(Ok(()))`: `key=value` changes nothing for `ptl <command>`; `Some(Err(reason))`: it would
/// and cannot; `None`: not one of Ultralytics' keys.
pub fn answer(command: &str, key: &str, value: &str) -> Option<Result<(), String>> {
    if let Some(r) = foreign_keys::check(key, value) {
        return Some(r);
    }
    let training = PoseTrainConfig::keys().iter().any(|(k, _, _)| *k == key) || ["amp", "verbose"].contains(&key);
    training.then(|| Err(format!("`{key}={value}` is a training setting: `ptl train` takes it, `ptl {command}` does not")))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    /// `(key, Ultralytics' default)` of 8.4.190's `cfg/default.yaml`.
    fn ultralytics_keys() -> Vec<(String, String)> {
        include_str!("../../trainer/tests/fixtures/ultralytics-8.4.190-default-keys.txt")
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    }

    #[derive(Parser)]
    struct Val {
        #[command(flatten)]
        a: super::super::predict::ValArgs,
    }

    #[derive(Parser)]
    struct Predict {
        #[command(flatten)]
        a: super::super::predict::PredictArgs,
    }

    /// Each key of the list with its default, given to `ptl val`, `ptl predict` and `ptl export`,
    /// is taken or refused with a message naming it — never "unknown key".
    #[test]
    fn every_ultralytics_key_is_taken_or_refused_by_name_in_val_predict_and_export() {
        let keys = ultralytics_keys();
        assert!(keys.len() >= 110);
        let mut taken = [0usize; 3];
        for (key, default) in &keys {
            let setting = format!("{key}={default}");
            let answers = [
                Val::try_parse_from(["val", setting.as_str()]).map_err(|e| e.to_string()).and_then(|mut v| v.a.apply_settings()),
                Predict::try_parse_from(["predict", setting.as_str()]).map_err(|e| e.to_string()).and_then(|mut p| p.a.apply_settings()),
                super::super::export::parse_keys(std::slice::from_ref(&setting)),
            ];
            for (n, a) in answers.into_iter().enumerate() {
                match a {
                    Ok(()) => taken[n] += 1,
                    Err(e) => assert!(e.contains(key.as_str()) && !e.contains("unknown key"), "`{setting}` ({n}): {e}"),
                }
            }
        }
        println!("taken as they are: val {}, predict {}, export {} of {}", taken[0], taken[1], taken[2], keys.len());
    }
}
