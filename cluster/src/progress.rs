//! The demo's progress display: a bar redrawn in place when stdout is a terminal, plain
//! loss lines otherwise (logs and CI stay readable).

use std::io::{IsTerminal, Write};

/// Progress over a known number of steps.
pub struct Progress {
    total: u64,
    tty: bool,
    drawn: bool,
    loss: f32,
    last_draw: Option<std::time::Instant>,
}

impl Progress {
    /// A display for `total` steps.
    pub fn new(total: u64) -> Progress {
        Progress {
            total: total.max(1),
            tty: std::io::stdout().is_terminal(),
            drawn: false,
            loss: f32::NAN,
            last_draw: None,
        }
    }

    /// Prints a line above the bar.
    pub fn line(&mut self, text: &str) {
        let mut out = std::io::stdout().lock();
        if self.drawn {
            // Clear the bar; it is redrawn on the next update.
            let _ = write!(out, "\r\x1b[2K");
            self.drawn = false;
        }
        let _ = writeln!(out, "{text}");
    }

    /// The loss shown next to the bar.
    pub fn set_loss(&mut self, loss: f32) {
        self.loss = loss;
    }

    /// Moves the bar to `done` steps, redrawing at most every 50 ms (and at the end).
    pub fn tick(&mut self, done: u64) {
        if !self.tty {
            return;
        }
        let now = std::time::Instant::now();
        if done < self.total
            && self
                .last_draw
                .is_some_and(|t| now.duration_since(t).as_millis() < 50)
        {
            return;
        }
        self.last_draw = Some(now);
        let loss = self.loss;
        const WIDTH: u64 = 40;
        let filled = (done.min(self.total) * WIDTH / self.total) as usize;
        let bar = format!(
            "{}{}",
            "#".repeat(filled),
            "-".repeat(WIDTH as usize - filled)
        );
        let mut out = std::io::stdout().lock();
        let _ = write!(
            out,
            "\r\x1b[2K  [{bar}] {done}/{} loss {loss:.4}",
            self.total
        );
        let _ = out.flush();
        self.drawn = true;
    }

    /// Removes the bar.
    pub fn finish(&mut self) {
        if self.drawn {
            let _ = write!(std::io::stdout().lock(), "\r\x1b[2K");
            self.drawn = false;
        }
    }
}
