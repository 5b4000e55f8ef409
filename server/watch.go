package server

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
)

// debounce groups the several events one save makes (truncate, write,
// rename, chmod) into one reload.
const debounce = 150 * time.Millisecond

// watchConfig calls reload after the config file changes, until ctx ends.
// It watches the file's directory, not the file: editors and Kubernetes
// ConfigMaps replace files by renaming, which a watch on the file loses.
func watchConfig(ctx context.Context, path string, log zerolog.Logger, reload func()) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch %s: %w", path, err)
	}
	defer w.Close()
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

// reloadFile reads the config file again and applies it. A file that does
// not parse or validate is refused; the configuration in force stays.
func reloadFile(ctx context.Context, rt *runtime, opts Options) {
	next, err := config.Load(opts.ConfigPath)
	if err == nil && opts.Overrides != nil {
		opts.Overrides(&next)
	}
	if err != nil {
		_ = rt.refuse("file", err)
		return
	}
	_, _ = rt.apply(ctx, next, "file")
}
