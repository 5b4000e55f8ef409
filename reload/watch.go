package reload

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
)

// debounce groups the several events one save makes into one reload. A
// save may truncate, write, rename and chmod.
const debounce = 150 * time.Millisecond

// watchConfig calls reload after the config file changes, until ctx ends.
// It watches the file's directory, not the file. Editors and Kubernetes
// ConfigMaps replace files by renaming, which a watch on the file loses.
func watchConfig(ctx context.Context, path string, log zerolog.Logger, reload func()) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch %s: %w", path, err)
	}
	defer func() { _ = w.Close() }() // the watch ends with ctx; nothing to report
	dir := filepath.Dir(path)
	if err := w.Add(dir); err != nil {
		return fmt.Errorf("watch %s: %w", dir, err)
	}
	log.Info().Str("file", path).Msg("watching the config file for changes")
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return nil
			}
			if ev.Has(fsnotify.Chmod) && !ev.Has(fsnotify.Write) {
				continue
			}
			timer.Reset(debounce)
		case err, ok := <-w.Errors:
			if !ok {
				return nil
			}
			log.Warn().Err(err).Msg("config watch")
		case <-timer.C:
			reload()
		}
	}
}

// WatchFile applies the config file at path each time it changes, until
// ctx ends. overrides, when set, re-applies command-line flags to every
// configuration read, so a reload does not undo them. A file that does not
// parse or validate is refused, and the configuration in force stays.
// WatchFile returns an error only when the file cannot be watched.
func (r *Runtime) WatchFile(ctx context.Context, path string, overrides func(*config.Config)) error {
	return watchConfig(ctx, path, r.log, func() { r.reloadFile(ctx, path, overrides) })
}

// reloadFile reads the config file again and applies it.
func (r *Runtime) reloadFile(ctx context.Context, path string, overrides func(*config.Config)) {
	var edits []func(*config.Config)
	if overrides != nil {
		edits = append(edits, overrides)
	}
	next, err := config.Load(path, edits...)
	if err != nil {
		_ = r.refuse("file", err)
		return
	}
	_, _ = r.Apply(ctx, next, "file")
}
